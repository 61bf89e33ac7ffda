"""What 03_streaming.py asks of the streaming model (streaming.py; the oracle and the trace suite are
stream/oracle.py's), each answer a dataclass read by name: §4.1's one-shot fetch (text, raw KV or a codec
level at each bandwidth) and its 8B-on-H100 note; §4.2's policies on one trace, why the run looks as it does
and which parts of the handout's shape it shows; the chunk-size trade-off; and the suite of random traces
(CacheGen's evaluation replays many). Nothing here prints; 03's page (stream/page.py) shows it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lecture27 import streaming as st
from lecture27.stream.oracle import oracle, promise_exceptions, run_suite, suite_summary
from common import timemodel as tm


# ------------------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Levels:
    """The codec's levels ([{level, bits_per_value, accuracy, ...}], finest first) and the accuracy of
    exact KV (raw FP16, or text recomputed), with where that accuracy comes from."""
    levels: list
    name: str                       # "record-world", "SmolLM2", or the --levels file's name
    lossless: float
    lossless_src: str


def levels_of(levels: list, name: str) -> Levels:
    """Levels with their lossless accuracy: the codec's FP16 accuracy if it reports one, else its finest
    level's (the codec's level 0 is built to lose no accuracy, handout §3.4)."""
    fp16 = [lv["fp16_accuracy"] for lv in levels if "fp16_accuracy" in lv]
    if fp16:
        return Levels(levels, name, fp16[0], "FP16 accuracy reported by the codec")
    best = max(levels, key=lambda d: d["accuracy"])
    return Levels(levels, name, best["accuracy"], f"taken as level {best['level']}'s (the codec reports no FP16 "
                                                  "accuracy)")


def trace_from(points) -> st.Trace:
    """A trace from its (from time s, Gb/s) points."""
    return st.Trace(tuple(t for t, _ in points), tuple(g for _, g in points))


def first_drop(trace: st.Trace):
    """(time, rate before, rate after) of the trace's first fall in bandwidth, or None."""
    for k in range(1, len(trace.times)):
        if trace.gbps[k] < trace.gbps[k - 1]:
            return trace.times[k], trace.gbps[k - 1], trace.gbps[k]
    return None


# ------------------------------------------------------------------------- §4.1: one shot
@dataclass(frozen=True)
class Bandwidth:
    gbps: float
    ttft: dict                      # option name -> seconds until the context is on the GPU
    fastest: str
    best: str                       # the fastest option within the no-loss margin of lossless
    vs_8bit: float                  # 8-bit quantized KV's TTFT over the finest level's (§4.1's headline)


@dataclass(frozen=True)
class Note8B:
    recompute_s: float
    raw_breakeven_gbit: float       # raw KV beats recomputing only above this bandwidth
    compression: float              # the compression that puts the break-even at the note's link
    levels_breakeven_gbit: dict     # level -> its break-even bandwidth


@dataclass(frozen=True, kw_only=True)
class OneShot:
    levels: Levels
    options: list                   # st.Option: raw, the levels finest first, text
    no_loss: list                   # the options within the no-loss margin of lossless
    rows: list                      # Bandwidth, one per link bandwidth
    recompute_s: float              # the whole context recomputed in one batch
    breakeven: dict                 # KV option -> the bandwidth at which fetching it takes as long as recomputing
    finest: st.Option
    best_ranges: list               # (option, lowest, highest bandwidth) of each run of bandwidths with the same best
    note: Note8B | None = None      # §4.1's note on a small model (recompute_or_fetch)


def runs_of_best(rows: list) -> list:
    """(option, lowest, highest bandwidth) of each run of consecutive bandwidths with the same best option."""
    out = []
    for b in rows:
        if out and out[-1][0] == b.best:
            out[-1] = (b.best, out[-1][1], b.gbps)
        else:
            out.append((b.best, b.gbps, b.gbps))
    return out


def one_shot(model, gpu, n_gpus, context, bandwidths, lv: Levels, no_loss_points, half_tokens) -> OneShot:
    """The whole context fetched at once over a steady link, at each bandwidth: as text (then recomputed),
    raw KV, or each codec level; the best option that loses at most `no_loss_points` of accuracy."""
    opts = st.kv_options(lv.levels, model, lv.lossless, with_raw=True)
    no_loss = sorted(o.name for o in opts if o.accuracy >= lv.lossless - no_loss_points)
    finest = next(o for o in opts if not o.recompute and o.name != "raw")
    eight = st.Option("8-bit", 8 * tm.kv_bytes_per_token(model) / 2, lv.lossless, bits_per_value=8.0)
    rows = []
    for g in bandwidths:
        ttft = st.whole_context_ttft(model, gpu, n_gpus, context, g, opts, half_tokens)
        t8 = st.whole_context_ttft(model, gpu, n_gpus, context, g, [eight], half_tokens)["8-bit"]
        rows.append(Bandwidth(g, ttft, min(ttft, key=ttft.get), min(no_loss, key=ttft.get), t8 / ttft[finest.name]))
    recompute = tm.prefill_time(model, gpu, context, 0, n_gpus)
    breakeven = {o.name: o.bits_per_token * context / recompute / st.GBIT for o in opts if not o.recompute}
    return OneShot(levels=lv, options=opts, no_loss=no_loss, rows=rows, recompute_s=recompute, breakeven=breakeven,
                   finest=finest, best_ranges=runs_of_best(rows))


def recompute_or_fetch(model, gpu, context, link_gbps, levels) -> Note8B:
    """§4.1's note: a small model on one GPU recomputes a context fast; which links lose to recomputing,
    and what compression would put the break-even at `link_gbps`?"""
    t = tm.prefill_time(model, gpu, context)
    raw_be = tm.kv_bytes_per_token(model) * 8 * context / t / st.GBIT
    values = tm.kv_bytes_per_token(model) / 2 * context
    return Note8B(t, raw_be, raw_be / link_gbps,
                  {f"level{lv['level']}": lv["bits_per_value"] * values / t / st.GBIT for lv in levels})


# ------------------------------------------------------------------------- §4.2: one trace
@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One chunk of a policy's run, as streaming.py records it (its row, read by name)."""
    start: float
    choice: str
    finish: float
    gpu_s: float
    measured_gbps: float | None
    link_end: float
    gpu_start: float | None
    est_gbps: float | None = None
    budget_s: float | None = None
    predicted: float | None = None
    gave_up: str | None = None
    probe: bool = False
    risked: bool = False

    @property
    def fit(self) -> bool:
        """Predicted to finish within its budget (not taken as the fastest option when nothing fit)."""
        return self.predicted <= self.start + self.budget_s + 1e-12


def chunks(result: st.Result) -> list[Chunk]:
    names = {f.name for f in dataclasses.fields(Chunk)}
    return [Chunk(**{k: v for k, v in row.items() if k in names}) for row in result.rows]


@dataclass(frozen=True)
class Policies:
    """The adaptive policy against always-finest, always-text and the oracle, in one model of the link and
    the GPU (streaming.advance)."""
    adaptive: st.Result
    finest: st.Result
    text: st.Result
    oracle: st.Result
    slo_s: float

    def named(self) -> dict:
        """Policy name -> its run, in the tables' order."""
        return {r.policy: r for r in (self.adaptive, self.finest, self.text, self.oracle)}

    def on_time(self, r: st.Result) -> bool:
        return r.ttft_s <= self.slo_s


def policies(setup: st.Setup, trace: st.Trace, slo: float, parallel: bool) -> Policies:
    return Policies(st.adaptive(setup, trace, slo, parallel=parallel),
                    st.fixed(setup, trace, setup.options[0].name, parallel=parallel),
                    st.fixed(setup, trace, "text", parallel=parallel), oracle(setup, trace, slo, parallel=parallel),
                    slo)


@dataclass(frozen=True, kw_only=True)
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
    coarser_chunks: list            # the chunks after the drop that took a coarser level
    by_time_left: list              # ... of them, those predicted to fit their budget
    finest_bits_per_value: float
    vs_8bit: float
    text_recompute_s: float         # all text, chunk by chunk
    text_breakeven_gbit: float      # below it text beats the coarsest level
    slowest_gbps: float             # the trace's slowest rate
    shape: dict                     # the handout's shape, part by part: did the adaptive run show it?
    worst_chunk: int                # the adaptive chunk that overran its predicted finish most


def explain(setup: st.Setup, runs: Policies, trace: st.Trace) -> Why:
    """Why a run looks as it does, from the data: how big the context is at the finest level and when it
    arrives, against the trace's first drop; the bandwidth below which text (recompute chunk by chunk)
    beats the coarsest level; and which parts of the handout's shape the adaptive run shows. A coarser
    level counts as "chosen by the time left" when it was predicted to fit its chunk's budget (not taken
    as the fastest option when nothing fit)."""
    finest, coarsest, text = setup.options[0], setup.options[-2], setup.option("text")
    ctx = setup.context_tokens
    recompute_s = sum(setup.recompute_s(f, n) for f, n in setup.plan)      # all text, chunk by chunk
    drop, ad, rows = first_drop(trace), runs.adaptive, chunks(runs.adaptive)
    after = [k for k, r in enumerate(rows) if drop and r.start >= drop[0]]
    before = [r.choice for r in rows if drop and r.start < drop[0]]
    coarser = [k for k in after if rows[k].choice not in (finest.name, "text")]
    by_time_left = [k for k in coarser if rows[k].fit]
    return Why(
        context=ctx, finest=finest.name, coarsest=coarsest.name, coarsest_accuracy=coarsest.accuracy,
        finest_gb=finest.bits_per_token * ctx / 8e9, finest_s=runs.finest.ttft_s, drop=drop,
        complete_before_drop=bool(drop) and ad.ttft_s <= drop[0], coarser_after_drop=bool(coarser),
        coarser_chunks=coarser, by_time_left=by_time_left, finest_bits_per_value=finest.bits_per_value,
        vs_8bit=8 / finest.bits_per_value, text_recompute_s=recompute_s,
        # text beats the coarsest level when its bits take longer than recomputing (token ids included)
        text_breakeven_gbit=(coarsest.bits_per_token - text.bits_per_token) * ctx / recompute_s / st.GBIT,
        slowest_gbps=min(trace.gbps),
        shape={"finest level while the link is good": bool(before) and set(before) == {finest.name},
               "text after the drop": any(rows[k].choice == "text" for k in after),
               "a coarser level after the drop, chosen by the time left": bool(by_time_left),
               "the SLO met": runs.on_time(ad)},
        worst_chunk=max(range(len(rows)), key=lambda k: rows[k].finish - rows[k].predicted))


@dataclass(frozen=True, kw_only=True)
class MeasuredLevel:
    """A level measured on a real model (codec/smollm2.py): its KL from FP16 and top-1 agreement, each with its
    standard error over paragraphs, and the paired step from the finer level (nan: not measured)."""
    level: int
    kl: float
    kl_se: float = math.nan
    agree_se: float = math.nan
    kl_step: float = math.nan
    kl_step_se: float = math.nan
    agree_step: float = math.nan
    agree_step_se: float = math.nan
    positions: int = 0
    paragraphs: int = 0


def measured(levels: list) -> list[MeasuredLevel]:
    """The levels as measured, finest first."""
    names = {f.name for f in dataclasses.fields(MeasuredLevel)}
    by_level = sorted(levels, key=lambda d: d["level"])
    return [MeasuredLevel(**{k: v for k, v in lv.items() if k in names}) for lv in by_level]


@dataclass(frozen=True)
class Noise:
    """Part 2c: are the levels' steps larger than their noise (two standard errors over paragraphs)?"""
    kl_clear: bool                  # KL grows level by level beyond the noise
    unclear: list                   # levels whose top-1 agreement moved within the noise


def level_noise_verdict(levels: list) -> Noise | None:
    """Does each level's step from the finer one stand out of the noise? None when no steps were measured."""
    steps = [lv for lv in measured(levels)[1:] if not math.isnan(lv.agree_step)]
    return Noise(all(lv.kl_step > 2 * lv.kl_step_se for lv in steps),
                 [f"level{lv.level}" for lv in steps if abs(lv.agree_step) <= 2 * lv.agree_step_se]
                 ) if steps else None


@dataclass(frozen=True, kw_only=True)
class TraceRun:
    """The policies on one context and trace, in both models of the link and the GPU."""
    setup: st.Setup
    trace: st.Trace
    levels_name: str                # where the levels come from (Levels.name)
    runs: Policies                  # in the run's model
    why: Why
    other: Policies                 # in the other model (Part 2d)
    parallel: bool                  # the run's model: the link and the GPU at once
    steady: st.Result | None = None  # the adaptive policy on a steady link
    levels: list | None = None      # Part 2c: the levels as measured on SmolLM2, with their noise
    noise: Noise | None = None

    def in_model(self, parallel: bool) -> Policies:
        return self.runs if parallel == self.parallel else self.other


def trace_run(setup: st.Setup, levels_name: str, trace: st.Trace, slo: float, parallel: bool,
              steady_gbps=None) -> TraceRun:
    """The four policies on `trace` in both models; the adaptive one also on a steady link if asked."""
    runs = policies(setup, trace, slo, parallel)
    steady = None if steady_gbps is None else st.adaptive(setup, st.Trace.steady(steady_gbps), slo, parallel=parallel)
    return TraceRun(setup=setup, trace=trace, levels_name=levels_name, runs=runs, why=explain(setup, runs, trace),
                    other=policies(setup, trace, slo, not parallel), parallel=parallel, steady=steady)


# ------------------------------------------------------------------------- §4.2: chunk size
@dataclass(frozen=True, kw_only=True)
class ChunkSize:
    chunk_tokens: int
    chunks: int
    slowdown: float                 # recompute of one chunk against the time model
    adaptive: st.Result
    oracle: st.Result
    text_ttft_s: float              # every chunk recomputed
    overrun_s: float                # reacting late: how far past its predicted finish the worst chunk ran


@dataclass(frozen=True)
class ChunkSizes:
    rows: list                      # ChunkSize, one per size
    small_batches_cost: bool        # all-text TTFT is longer with the smallest chunks than with the largest
    latest: ChunkSize               # the size whose worst chunk overran most
    before_drop: bool               # at every size the context is in before the trace's first drop


def chunk_size(setup: st.Setup, trace: st.Trace, slo: float, parallel: bool, half_tokens) -> ChunkSize:
    ad = st.adaptive(setup, trace, slo, parallel=parallel)
    n = setup.plan[0][1]
    return ChunkSize(chunk_tokens=n, chunks=len(setup.plan), slowdown=st.batch_slowdown(n, half_tokens), adaptive=ad,
                     oracle=oracle(setup, trace, slo, parallel=parallel),
                     text_ttft_s=st.fixed(setup, trace, "text", parallel=parallel).ttft_s,
                     overrun_s=max(r.finish - r.predicted for r in chunks(ad)))


def chunk_sizes(rows: list, trace: st.Trace) -> ChunkSizes:
    """The chunk-size trade-off's verdicts over one ChunkSize per size."""
    by_size, drop = sorted(rows, key=lambda c: c.chunk_tokens), first_drop(trace)
    return ChunkSizes(rows, by_size[0].text_ttft_s > by_size[-1].text_ttft_s * 1.001,
                      max(rows, key=lambda c: c.overrun_s),
                      drop is not None and all(c.adaptive.ttft_s <= drop[0] for c in rows))


# ------------------------------------------------------------------------- §4.2 on a suite of traces
SUITE_SHOWN = ["adaptive", "naive adaptive", "always level0", "always text", "oracle"]


@dataclass(frozen=True)
class Summary:
    """One policy over the suite (stream/oracle.py's suite_summary) and its 95th-percentile TTFT."""
    violation_rate: float
    mean_ttft_s: float
    mean_quality: float
    mean_quality_on_time: float
    mean_text_tokens: float
    p95_ttft_s: float


@dataclass(frozen=True, kw_only=True)
class Broken:
    """A trace where a fixed policy met the SLO and the adaptive one did not, with the reason
    (stream/oracle.py's promise_exceptions): the adaptive chunk that overran its prediction most."""
    trace: int
    fixed_met: list
    adaptive_ttft_s: float
    chunk: int
    choice: str
    est_gbps: float
    start_s: float
    predicted_s: float
    finish_s: float
    lowest_gbps: float


@dataclass(frozen=True)
class InModel:
    """The suite in one model of the link and the GPU."""
    parallel: bool
    policies: dict                  # policy -> Summary
    exceptions: list                # Broken

    @property
    def adaptive(self) -> Summary:
        return self.policies["adaptive"]


def in_model(setup: st.Setup, traces: list, slo: float, parallel: bool) -> tuple[dict, InModel]:
    """({policy: [st.Result per trace]}, the summaries and broken promises) in one model."""
    runs = run_suite(setup, traces, slo, SUITE_SHOWN, parallel=parallel)
    summary = {p: Summary(**suite_summary(r, slo), p95_ttft_s=st.ttft_percentile(r, 0.95)) for p, r in runs.items()}
    return runs, InModel(parallel, summary, [Broken(**e) for e in promise_exceptions(runs, traces, slo)])


@dataclass(frozen=True, kw_only=True)
class SuiteCell:
    """One level set and context over the suite."""
    levels: str
    context: int
    runs: dict                      # policy -> [st.Result per trace], in the run's model
    model: InModel                  # in the run's model
    other: InModel                  # in the other model
    best_fixed: str                 # the fixed policy missing the SLO least
    rate_ok: bool                   # adaptive misses no more often than the best fixed policy
    quality_on_time_ok: bool        # adaptive's on-time quality at least always level0's

    @property
    def level0(self) -> Summary:
        return self.model.policies["always level0"]

    def in_model(self, parallel: bool) -> InModel:
        return self.model if parallel == self.model.parallel else self.other


def suite_cell(name: str, setup: st.Setup, traces: list, slo: float, parallel: bool) -> SuiteCell:
    """One level set and context over the traces: per policy a summary, the traces where a fixed policy met
    the SLO and the adaptive one did not (with the reason), the same in the other model for comparison."""
    runs, model = in_model(setup, traces, slo, parallel)
    _, other = in_model(setup, traces, slo, not parallel)
    fixed = {p: model.policies[p].violation_rate for p in ("always level0", "always text")}
    ad = model.adaptive
    return SuiteCell(levels=name, context=setup.context_tokens, runs=runs, model=model, other=other,
                     best_fixed=min(fixed, key=fixed.get), rate_ok=ad.violation_rate <= min(fixed.values()) + 1e-12,
                     quality_on_time_ok=ad.mean_quality_on_time
                     >= model.policies["always level0"].mean_quality_on_time - 1e-12)


@dataclass(frozen=True)
class Suite:
    traces: list
    cells: list                     # SuiteCell, each level set then each context


def suite(traces: list, level_sets: list, contexts, setup_for, slo: float, parallel: bool) -> Suite:
    """Every level set (Levels) and context over the traces; setup_for(context, levels) gives the chunked
    fetch of one (streaming.make_setup)."""
    return Suite(traces, [suite_cell(lv.name, setup_for(ctx, lv), traces, slo, parallel)
                          for lv in level_sets for ctx in contexts])

"""03 -- CacheGen part two (handout §4): when to send KV and when to send text, and adapting to a link
whose bandwidth changes while a context streams in.

    python code/lecture27/03_streaming.py                       # Parts 1-3, four figures
    python code/lecture27/03_streaming.py --json out.json       # + headline figures as JSON
    python code/lecture27/03_streaming.py --trace my.csv --slo 3 --chunk-tokens 1024
    python code/lecture27/03_streaming.py --long-context 65536  # Part 2b with a 64K-token context
    python code/lecture27/03_streaming.py --no-real             # without Parts 2c and 5 (no SmolLM2 needed)
    python code/lecture27/03_streaming.py --no-wire             # without Part 5 (SmolLM2 on a socket, ~half a minute)
    python code/lecture27/03_streaming.py --trace-suite 200     # + Part 4: 200 random traces, CDF figure
    python code/lecture27/03_streaming.py --serial              # one chunk at a time: the link idle during a recompute
    python code/lecture27/03_streaming.py --wire-scale 250      # Part 5 on a link twice as fast
    python code/lecture27/03_streaming.py --trace code/lecture27/stream/traces/collapse.csv   # also ramp, bursts

Part 1 (§4.1, pitfall 1): LLaMA-3.1-70B on 4 x A100 fetching a 12K-token context over a steady link:
        time to first token sending text (then recomputing), raw KV, or KV at each codec level; the
        8B-on-H100 note.
Part 2 (§4.2): the adaptive policy chunk by chunk on a trace (10 -> 1 -> 5 Gb/s, SLO 4 s), against
        always-finest, always-text and an oracle that knows the trace; a steady 25 Gb/s link; why the run
        looks as it does (sizes, the drop, text's break-even).
Part 2b (§4.2, longer context): the same trace and SLO with 48K tokens, still streaming when the link
        drops, so the policy has something to adapt to.
Part 2c (§4.2, real levels): Part 2 again with the levels measured on a real LLaMA (SmolLM2-135M,
        codec/smollm2.py). The record-world model tolerates about 1.8 bits per value, a real LLaMA needs
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
Part 5 (§4.2 over a real connection, as CacheGen's evaluation streams real bitstreams over a shaped link):
        SmolLM2's KV of a WIRE_CONTEXT-token context, coded at Part 2c's levels (each in the stream layout
        read and decoded soonest at the handout trace's mean rate over the SLO window, scaled), streamed chunk
        by chunk through a localhost socket paced by a sender process (wire.py) to that trace, a steady one
        and two of the suite's, bandwidths divided by WIRE_SCALE; each policy, its text chunks recomputed
        for real on this CPU, its KV chunks decoded as they arrive; beside each run the simulator fed this
        CPU's measured recompute and decode times, the cause of every gap above 10% named; a sender killed
        mid-stream; the answer checked against a full prefill. About a minute on a busy 2-core machine.
The codec's four levels come from cs.codec_levels() (measured by 02 on the record-world model) and,
for Parts 2c and 5, smollm2.real_codec_levels() (fitted on first use, about a minute, then cached; Part 5's
codec tables at those levels: smollm2.real_codec_specs()); the simulation and the policy are in streaming.py,
the oracle and the trace suite in stream/oracle.py, the socket in wire.py, the runs on it in stream/ (measure,
wire_runs, simulated, compare, wire_study).
Recompute times: common/timemodel.py.
This file holds the inputs (the constants, the command line) and one function per Part; what each Part asks
of streaming.py is in stream/study.py, how it is shown (tables, notes, figures, --json) in stream/page.py (Part 5's
in stream/wire_page.py).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lecture27.codec import smollm2
from lecture27.codec import study as cs
from lecture27 import streaming as st
from lecture27.stream import study
from lecture27.stream.oracle import trace_suite
from lecture27.stream import wire_study
from common.cli import (Parser, fail, nonneg_int, positive_float, positive_int, settings,
                        settings_from, shipped_defaults)
from common.measured import cached_measurement, measured_note
from common.gguf_llama import smollm2_or_explain
from common.present import Page
from lecture27.stream.page import (show_models, show_part1, show_part2, show_part2_long,
                                   show_part2_real, show_part3, show_part4, show_setup, show_skipped)
from lecture27.stream.wire_page import show_wire

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
SUITE_TRACES = 0               # --trace-suite N (0: no Part 4); 200 is the study in docs/numbers.md
SUITE_SEED = 0                 # the suite's random seed
SUITE_CONTEXTS = [12 * K, 48 * K]
SUITE_GBPS = [0.1, 0.3, 1.0, 3.0, 10.0, 25.0]   # the Markov chain's bandwidth states, Gb/s
SUITE_DWELL_S = (0.1, 2.0)     # each state lasts a uniform time in this range
SUITE_JUMP = 0.2               # chance that a change jumps to any state (else to a neighbouring one)
SUITE_HORIZON_S = 30.0         # traces are drawn this far; the last rate then holds
SUITE_EXCEPTIONS_SHOWN = 10    # at most this many broken promises printed per context and level set
# ---- Part 5 (§4.2 over a real connection: SmolLM2 on this CPU, a paced localhost socket)
WIRE_CONTEXT = 128             # tokens of context (SmolLM2 holds 8,192; each chunk decodes or recomputes for real)
WIRE_CHUNK_TOKENS = 32         # tokens per chunk: 4 chunks, each run about a second on this CPU
WIRE_SCALE = 500.0             # every bandwidth of a trace divided by this: 14.2 (LLaMA-3.1-70B's KV bytes per
                               # token over SmolLM2's) x 35 (so that SmolLM2's chunks take about as long on the
                               # link as this CPU takes to decode them)
WIRE_SLO = 1.5                 # seconds: the runs' SLO
WIRE_SUITE_TRACES = (4, 15)    # the two of the suite's traces (SUITE_SEED's, numbered from 0): a rising, a falling
WIRE_ITEM = 2                  # the RAG item (common/english.py) whose passages open the context
WIRE_ANSWER_TOKENS = 4         # greedy tokens of the answer compared with the full prefill's
# ---- files instead of the constants above
TRACE_FILE = None              # --trace FILE: a CSV trace instead of TRACE
LEVELS_FILE = None             # --levels FILE: a JSON list of levels instead of the codec's (exercises, tests)


@settings(globals())
class Settings:
    """One run's inputs: the constants above, as the command line left them (field = constant's name)."""


SMOLLM2_WINDOW = 8192          # SmolLM2's context window (its model card)


# ------------------------------------------------------------------------------------------ inputs
def parse(argv=None) -> tuple:
    """(this run's Settings, the defaults' Settings, the parsed command line: --json, --no-plot, --no-real and
    --no-wire say how the run is shown and how far it goes, not its inputs)."""
    p = Parser(__doc__)
    p.add_argument("--trace", dest="trace_file", metavar="FILE", default=TRACE_FILE,
                   help="CSV 'time_s,gbit_per_s' per line (rate from that time on); default: TRACE (§4.2)")
    p.add_argument("--slo", type=positive_float, default=SLO, help="seconds until the context must be on the GPU")
    p.add_argument("--chunk-tokens", type=positive_int, default=CHUNK_TOKENS, help="tokens per chunk (Part 2)")
    p.add_argument("--long-context", type=positive_int, default=LONG_CONTEXT,
                   help=f"tokens of context in Part 2b (at most {MAX_CONTEXT}, LLaMA-3.1's window)")
    p.add_argument("--levels", dest="levels_file", metavar="FILE", default=LEVELS_FILE,
                   help="JSON list of codec levels instead of cs.codec_levels()")
    p.add_argument("--half-tokens", dest="half_efficiency_tokens", type=positive_float, default=HALF_EFFICIENCY_TOKENS,
                   help="recompute batch size that runs at half speed (the small-batch assumption)")
    p.add_argument("--trace-suite", dest="suite_traces", type=nonneg_int, default=SUITE_TRACES, metavar="N",
                   help="Part 4: N random traces (0: skip)")
    p.add_argument("--suite-seed", type=nonneg_int, default=SUITE_SEED, help="the trace suite's random seed")
    p.add_argument("--no-real", action="store_true", help="skip Parts 2c and 5 (SmolLM2's levels, SmolLM2 on a socket)")
    p.add_argument("--no-wire", action="store_true", help="skip Part 5 (SmolLM2's KV over a paced socket)")
    p.add_argument("--remeasure", action="store_true",
                   help="Part 5: measure again (a later run shows the times measured on this machine before)")
    p.add_argument("--serial", dest="parallel", action="store_false", default=PARALLEL,
                   help="one chunk at a time: the link waits while the GPU recomputes (default: both work at once)")
    p.add_argument("--wire-context", type=positive_int, default=WIRE_CONTEXT,
                   help=f"Part 5: tokens of context (at most {SMOLLM2_WINDOW // 2}, half SmolLM2's window)")
    p.add_argument("--wire-chunk-tokens", type=positive_int, default=WIRE_CHUNK_TOKENS, help="Part 5: tokens per chunk")
    p.add_argument("--wire-scale", type=positive_float, default=WIRE_SCALE,
                   help="Part 5: every bandwidth of a trace divided by this")
    p.add_argument("--wire-slo", type=positive_float, default=WIRE_SLO, help="Part 5: the runs' SLO, seconds")
    a = p.parse_args(argv)
    if a.chunk_tokens > CONTEXT:
        p.error(f"argument --chunk-tokens: at most the context, {CONTEXT}")
    if a.long_context > MAX_CONTEXT:
        p.error(f"argument --long-context: at most {MAX_CONTEXT} (LLaMA-3.1's context window)")
    if a.wire_context > SMOLLM2_WINDOW // 2:
        p.error(f"argument --wire-context: at most {SMOLLM2_WINDOW // 2} (half SmolLM2's window, the rest for the "
                "question and the answer)")
    if a.wire_chunk_tokens > a.wire_context:
        p.error(f"argument --wire-chunk-tokens: at most the context, {a.wire_context}")
    return (settings_from(Settings, a, globals(), trace=load_trace(a.trace_file)),
            shipped_defaults(Settings, globals()), a)


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
    """The codec's levels: cs.codec_levels() (measured by 02, cached), or a JSON file of
    [{"level", "bits_per_value", "accuracy"}, ...] (for exercises and tests)."""
    if path is None:
        return cs.codec_levels()  # trains the record model and fits the codec on first use
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


def codec_levels(s: Settings) -> study.Levels:
    """The levels of Parts 1-4: the record-world codec's, or the --levels file's."""
    return study.levels_of(load_levels(s.levels_file),
                           "record-world" if s.levels_file is None else Path(s.levels_file).name)


def real_levels(asked: bool) -> tuple[study.Levels | None, list]:
    """Part 2c's levels, measured on SmolLM2 (fitted on first use, about a minute), or None and why not."""
    skipped = []
    if not asked or smollm2_or_explain(say=skipped.append) is None:
        return None, skipped
    return study.Levels(smollm2.real_codec_levels(), "SmolLM2", 1.0, "exact"), skipped


def setup_for(s: Settings, context: int, chunk_tokens: int, lv: study.Levels) -> st.Setup:
    return st.make_setup(s.model, s.gpu, s.n_gpus, context, chunk_tokens, lv.levels, lv.lossless,
                         s.half_efficiency_tokens)


# ------------------------------------------------------------------------------------------ the Parts
def part1(s: Settings, lv: study.Levels) -> study.OneShot:
    """§4.1: the whole context fetched at once over a steady link, at each bandwidth; the 8B note."""
    return dataclasses.replace(study.one_shot(s.model, s.gpu, s.n_gpus, s.context, s.bandwidths, lv, s.no_loss_points,
                                              s.half_efficiency_tokens), note=note_8b(s, lv.levels))


def note_8b(s: Settings, levels: list) -> study.Note8B:
    """§4.1's note: 8B on one H100 recomputes 12K tokens in 0.36 s; which links lose to recomputing?"""
    return study.recompute_or_fetch(s.note_model, s.note_gpu, s.context, s.note_link_gbps, levels)


def part2(s: Settings, lv: study.Levels) -> study.TraceRun:
    """§4.2: the policies on the trace, chunks of CHUNK_TOKENS, and the adaptive one on a steady link."""
    return study.trace_run(setup_for(s, s.context, s.chunk_tokens, lv), lv.name, study.trace_from(s.trace), s.slo,
                           s.parallel, s.steady_gbps)


def part2_long(s: Settings, lv: study.Levels) -> study.TraceRun:
    """Part 2b: the same policies on a longer context (the same trace, SLO and chunk size)."""
    return study.trace_run(setup_for(s, s.long_context, s.chunk_tokens, lv), lv.name, study.trace_from(s.trace),
                           s.slo, s.parallel)


def part2_real(s: Settings, lv: study.Levels) -> study.TraceRun:
    """Part 2c: Part 2 with the levels measured on SmolLM2, and whether their steps stand out of the noise."""
    return dataclasses.replace(part2(s, lv), levels=lv.levels, noise=study.level_noise_verdict(lv.levels))


def part3(s: Settings, lv: study.Levels) -> study.ChunkSizes:
    """§4.2's chunk-size trade-off on the same trace: each size of CHUNK_SIZES."""
    trace = study.trace_from(s.trace)
    return study.chunk_sizes([study.chunk_size(setup_for(s, s.context, n, lv), trace, s.slo, s.parallel,
                                               s.half_efficiency_tokens) for n in s.chunk_sizes], trace)


def part4(s: Settings, level_sets: list) -> study.Suite:
    """The trace suite: SUITE_TRACES traces from the Markov chain (SUITE_*), each context of SUITE_CONTEXTS
    and each level set."""
    traces = trace_suite(s.suite_traces, s.suite_seed, s.suite_gbps, s.suite_dwell_s, s.suite_jump,
                         s.suite_horizon_s)
    return study.suite(traces, level_sets, s.suite_contexts, lambda ctx, lv: setup_for(s, ctx, s.chunk_tokens, lv),
                       s.slo, s.parallel)


def part5_wire(s: Settings, real: study.Levels, remeasure: bool = False) -> tuple:
    """§4.2 over a real connection: the handout's trace, a steady one and WIRE_SUITE_TRACES of the suite,
    each policy on a paced socket and in the simulator fed this CPU's times; then the sender killed. Measured
    once on this machine and cached (measured.cached_measurement): (wire_study.WireStudy, when and where)."""
    suite = trace_suite(max(s.wire_suite_traces) + 1, s.suite_seed, s.suite_gbps, s.suite_dwell_s, s.suite_jump,
                        s.suite_horizon_s)
    traces = {"handout": study.trace_from(s.trace), "steady": st.Trace.steady(s.steady_gbps),
              **{f"suite {i}": suite[i] for i in s.wire_suite_traces}}
    accuracy = {lv["level"]: lv["accuracy"] for lv in real.levels}
    inputs = {"traces": traces, "accuracy": accuracy,
              **{k: v for k, v in vars(s).items() if k.startswith("wire_")}}
    return cached_measurement("wire-smollm2", inputs, lambda: wire_study.wire_study(
        smollm2.real_codec_specs(), traces, s.wire_context, s.wire_chunk_tokens, s.wire_scale, s.wire_slo, accuracy,
        s.wire_answer_tokens, s.wire_item), remeasure, tag="03")


# -------------------------------------------------------------------------------------------- main
def main(argv=None) -> Page:
    """Each Part computed, then shown; the page (its tables, notes and --json) is returned for tests."""
    s, defaults, a = parse(argv)
    page = Page("03", "CacheGen part two: streaming with adaptation", "§4", s, defaults, plot=not a.no_plot)
    lv = codec_levels(s)
    real, skipped = real_levels(not a.no_real)
    show_part1(page, part1(s, lv), s)                                   # §4.1, pitfall 1
    p2, p2b = part2(s, lv), part2_long(s, lv)
    show_part2(page, p2, s)                                             # §4.2
    show_part2_long(page, p2b, s)                                       # §4.2, a longer context
    p2c = part2_real(s, real) if real else None
    if p2c:
        show_part2_real(page, p2c, s, smollm2.REAL_MAX_KL)                                   # §4.2, real levels
    show_skipped(page, skipped)
    show_models(page, [p2, p2b, p2c], s)                                # Part 2d (§4.2), both models
    show_part3(page, part3(s, lv), s)                                   # §4.2, chunk size
    if s.suite_traces:
        show_part4(page, part4(s, [lv] + [real] * bool(real)), s)       # §4.2 on many traces
    if real and not a.no_wire:
        wire, when = part5_wire(s, real, a.remeasure)
        show_wire(page, wire, s)                                        # §4.2 over a real connection
        page.say(measured_note(when))
    show_skipped(page, skipped, "Part 5 (§4.2 over a real connection)")
    show_setup(page, s)
    page.finish(a.json)
    return page


if __name__ == "__main__":
    main()

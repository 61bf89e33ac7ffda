"""03 -- CacheGen part two (handout §4): when to send KV and when to send text, and adapting to a link
whose bandwidth changes while a context streams in.

    python code/lecture27/03_streaming.py                       # Parts 1-3, four figures
    python code/lecture27/03_streaming.py --json out.json       # + headline figures as JSON
    python code/lecture27/03_streaming.py --trace my.csv --slo 3 --chunk-tokens 1024
    python code/lecture27/03_streaming.py --long-context 65536  # Part 2b with a 64K-token context
    python code/lecture27/03_streaming.py --no-real             # without Part 2c (no SmolLM2 needed)
    python code/lecture27/03_streaming.py --trace-suite 200     # + Part 4: 200 random traces, CDF figure

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
Part 3 (§4.2): the chunk-size trade-off on the same trace.
Part 4 (§4.2 on many traces, --trace-suite N): one trace shows a mechanism, not whether a policy is good.
        CacheGen's evaluation replays many bandwidth traces; here N seeded Markov-chain traces x two
        contexts x both level sets, and per policy the SLO-violation rate, TTFT, quality and recomputed
        tokens, a CDF of TTFT, and the promise checked: adaptive meets the SLO wherever a fixed policy does.
The codec's four levels come from codec_study.codec_levels() (measured by 02 on the record-world model) and,
for Part 2c, codec_real.real_codec_levels() (fitted on first use, about a minute, then cached); the
simulation, the policy and the oracle are in streaming.py. Recompute times: common/timemodel.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codec_real as cr  # noqa: E402
import codec_study  # noqa: E402
import streaming as st  # noqa: E402
from common import timemodel as tm  # noqa: E402
from common.cli import Parser, fail, figure_path, positive_float, positive_int, say, table, write_json  # noqa: E402

from common.gguf_llama import smollm2_or_explain  # noqa: E402

K = 1024
# ---- Part 1 (§4.1)
MODEL, GPU, N_GPUS = "llama-3.1-70b", "A100-80GB", 4   # §4.1: LLaMA-3.1-70B on 4 x A100
CONTEXT = 12 * K                                       # §4.1: a 12K-token context
BANDWIDTHS = [0.5, 1, 2, 3, 5, 10, 15, 25, 50, 100]    # Gb/s, the range 0.5-100
NOTE_MODEL, NOTE_GPU = "llama-3.1-8b", "H100"          # §4.1 / pitfall 1: 8B on one H100
NO_LOSS_POINTS = 0.005   # a level counts as lossless within 0.5 accuracy points of FP16 (the codec issue's bar)
# ---- Part 2 (§4.2)
CHUNK_TOKENS = 1536      # §4.2: chunks of 1.5K tokens (CacheGen's default)
TRACE = [(0.0, 10.0), (0.3, 1.0), (3.0, 5.0)]  # §4.2: (from time s, Gb/s): 10 Gb/s for 0-0.3 s, 1 Gb/s to 3 s, then 5
SLO = 4.0                # §4.2: seconds
STEADY_GBPS = 25.0       # §4.2: "a steady 25 Gb/s link picks the finest level throughout"
LONG_CONTEXT = 48 * K    # Part 2b: long enough to still be streaming when the link drops (not in the handout)
MAX_CONTEXT = 128 * K    # LLaMA-3.1's context window (Meta's model card: 128K tokens)
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

# The handout's statements, printed beside ours (reference only; nothing is computed from them)
HANDOUT = {
    "part1": "text wins at low bandwidth, compressed KV at high",
    "8b_recompute_s": 0.36, "8b_breakeven_gbit": 25,
    "trace": "finest level while the link is good, text after the drop, a coarser level at the end "
             "chosen by the time left (this small model's level 3 answers only 74%)",
    "codec_vs_8bit": 1.66,   # §3: the handout's lossless codec is 1.66x smaller than 8-bit quantization
    "steady": "the finest level throughout",
    "cachegen_delay": "3.2-3.7x",   # §4.1: CacheGen's delay to fetch and process a context vs quantization
    "chunks": "large chunks react late; small chunks recompute in small GPU batches",
}
SUITE_SHOWN = ["adaptive", "naive adaptive", "always level0", "always text", "oracle"]
SHORT = {"text": "T", "raw": "R", "level0": "L0", "level1": "L1", "level2": "L2", "level3": "L3"}


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


def load_levels(path: str | None) -> list[dict]:
    """The codec's levels: kvcache.codec_levels() (measured by 02, cached), or a JSON file of
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


def load_trace(path: str | None) -> st.Trace:
    if path is None:
        return st.Trace(tuple(t for t, _ in TRACE), tuple(g for _, g in TRACE))
    try:
        return st.parse_trace(Path(path).read_text())
    except OSError as e:
        fail(f"--trace {path}: {e.strerror}")
    except ValueError as e:
        fail(f"--trace {path}: {e}")


# ------------------------------------------------------------------------------------- calculators
def part1(levels, lossless, bandwidths, half=HALF_EFFICIENCY_TOKENS):
    opts = st.kv_options(levels, MODEL, lossless, with_raw=True)
    no_loss = {o.name for o in opts if o.accuracy >= lossless - NO_LOSS_POINTS}
    rows = []
    for g in bandwidths:
        ttft = st.whole_context_ttft(MODEL, GPU, N_GPUS, CONTEXT, g, opts, half)
        rows.append({"gbps": g, "ttft": ttft, "fastest": min(ttft, key=ttft.get),
                     "best": min(no_loss, key=ttft.get)})
    eight = st.Option("8-bit", 8 * tm.kv_bytes_per_token(MODEL) / 2, lossless, bits_per_value=8.0)
    finest = next(o for o in opts if not o.recompute and o.name != "raw")
    for r in rows:   # §4.1's headline: CacheGen's delay against the quantization baseline
        r["vs_8bit"] = st.whole_context_ttft(MODEL, GPU, N_GPUS, CONTEXT, r["gbps"], [eight], half)["8-bit"] \
            / r["ttft"][finest.name]
    recompute = tm.prefill_time(MODEL, GPU, CONTEXT, 0, N_GPUS)
    # break-even: the bandwidth at which fetching an option's bits takes as long as recomputing
    breakeven = {o.name: o.bits_per_token * CONTEXT / recompute / st.GBIT for o in opts if not o.recompute}
    return opts, no_loss, rows, recompute, breakeven


def note_8b(levels):
    """§4.1's note: 8B on one H100 recomputes 12K tokens in 0.36 s; which links lose to recomputing?"""
    t = tm.prefill_time(NOTE_MODEL, NOTE_GPU, CONTEXT)
    raw_bits = tm.kv_bytes_per_token(NOTE_MODEL) * 8 * CONTEXT
    values = tm.kv_bytes_per_token(NOTE_MODEL) / 2 * CONTEXT
    raw_be = raw_bits / t / st.GBIT
    return {"recompute_s": t, "raw_breakeven_gbit": raw_be,
            "compression_for_handout": raw_be / HANDOUT["8b_breakeven_gbit"],
            "levels_breakeven_gbit": {f"level{lv['level']}": lv["bits_per_value"] * values / t / st.GBIT
                                      for lv in levels}}


def policies(setup, trace, slo) -> dict:
    """The adaptive policy against always-finest, always-text and the oracle."""
    finest = setup.options[0].name
    return {"adaptive": st.adaptive(setup, trace, slo), f"always {finest}": st.fixed(setup, trace, finest),
            "always text": st.fixed(setup, trace, "text"), "oracle": st.oracle(setup, trace, slo)}


def part2(levels, lossless, trace, slo, chunk_tokens, half=HALF_EFFICIENCY_TOKENS):
    setup = st.make_setup(MODEL, GPU, N_GPUS, CONTEXT, chunk_tokens, levels, lossless, half)
    return setup, policies(setup, trace, slo), st.adaptive(setup, st.Trace.steady(STEADY_GBPS), slo)


def part2_long(levels, lossless, trace, slo, chunk_tokens, context, half=HALF_EFFICIENCY_TOKENS):
    """Part 2b: the same policies on a longer context (the same trace, SLO and chunk size)."""
    setup = st.make_setup(MODEL, GPU, N_GPUS, context, chunk_tokens, levels, lossless, half)
    return setup, policies(setup, trace, slo)


def first_drop(trace):
    """(time, rate before, rate after) of the trace's first fall in bandwidth, or None."""
    for k in range(1, len(trace.times)):
        if trace.gbps[k] < trace.gbps[k - 1]:
            return trace.times[k], trace.gbps[k - 1], trace.gbps[k]
    return None


def explain(setup, runs, trace):
    """Why a run looks as it does, from the data: how big the context is at the finest level and when it
    arrives, against the trace's first drop; how our codec compares with the handout's; the bandwidth
    below which text (recompute chunk by chunk) beats the coarsest level; and which parts of the
    handout's shape the adaptive run shows."""
    finest, coarsest, text = setup.options[0], setup.options[-2], setup.option("text")
    ctx = setup.context_tokens
    recompute_s = sum(setup.recompute_s(f, n) for f, n in setup.plan)      # all text, chunk by chunk
    drop = first_drop(trace)
    ad = runs["adaptive"]
    after = [r["choice"] for r in ad.rows if drop and r["start"] >= drop[0]]
    before = [r["choice"] for r in ad.rows if drop and r["start"] < drop[0]]
    ours_bits = finest.bits_per_value
    handout_bits = 8 / HANDOUT["codec_vs_8bit"]
    return {
        "context": ctx, "finest": finest.name, "coarsest": coarsest.name, "coarsest_accuracy": coarsest.accuracy,
        "finest_gb": finest.bits_per_token * ctx / 8e9,
        "finest_s": runs[f"always {finest.name}"].ttft_s,
        "drop": drop,
        "finest_bits_per_value": ours_bits, "vs_8bit": 8 / ours_bits,
        "handout_bits_per_value": handout_bits, "handout_over_ours": handout_bits / ours_bits,
        "text_recompute_s": recompute_s,
        # text beats the coarsest level when its bits take longer than recomputing (token ids included)
        "text_breakeven_gbit": (coarsest.bits_per_token - text.bits_per_token) * ctx / recompute_s / st.GBIT,
        "shape": {"complete before the drop": bool(drop) and ad.ttft_s <= drop[0],
                  "finest level while the link is good": bool(before) and set(before) == {finest.name},
                  "text after the drop": "text" in after,
                  "a coarser level after the drop": any(c not in (finest.name, "text") for c in after)},
    }


def part3(levels, lossless, trace, slo, sizes, half=HALF_EFFICIENCY_TOKENS):
    rows = []
    for n in sizes:
        setup = st.make_setup(MODEL, GPU, N_GPUS, CONTEXT, n, levels, lossless, half)
        ad = st.adaptive(setup, trace, slo)
        rows.append({"chunk_tokens": n, "chunks": len(setup.plan), "slowdown": st.batch_slowdown(n, half),
                     "adaptive": ad, "oracle": st.oracle(setup, trace, slo),
                     "text_ttft_s": st.fixed(setup, trace, "text").ttft_s,
                     # reacting late: how far past its predicted finish the worst chunk ran
                     "overrun_s": max(r["finish"] - r["predicted"] for r in ad.rows)})
    return rows


def part4(level_sets, n, seed, slo, chunk_tokens, half=HALF_EFFICIENCY_TOKENS):
    """The trace suite: n traces from the Markov chain (SUITE_*), each context of SUITE_CONTEXTS and each
    level set {name: (levels, lossless accuracy)}; per policy a summary over the traces, and the traces
    where a fixed policy met the SLO and the adaptive one did not (with the reason)."""
    traces = st.trace_suite(n, seed, SUITE_GBPS, SUITE_DWELL_S, SUITE_JUMP, SUITE_HORIZON_S)
    cells = []
    for name, (levels, lossless) in level_sets.items():
        for ctx in SUITE_CONTEXTS:
            setup = st.make_setup(MODEL, GPU, N_GPUS, ctx, chunk_tokens, levels, lossless, half)
            runs = st.run_suite(setup, traces, slo, SUITE_SHOWN)
            summary = {p: st.suite_summary(r, slo) | {"p95_ttft_s": st.ttft_percentile(r, 0.95)}
                       for p, r in runs.items()}
            fixed = {p: summary[p]["violation_rate"] for p in ("always level0", "always text")}
            ad = summary["adaptive"]
            cells.append({"levels": name, "context": ctx, "runs": runs, "summary": summary,
                          "exceptions": st.promise_exceptions(runs, traces, slo),
                          "best_fixed": min(fixed, key=fixed.get),
                          "rate_ok": ad["violation_rate"] <= min(fixed.values()) + 1e-12,
                          "quality_on_time_ok": ad["mean_quality_on_time"]
                          >= summary["always level0"]["mean_quality_on_time"] - 1e-12})
    return traces, cells


# ---------------------------------------------------------------------------------------- printing
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
    extra = [f"{gave_up} KV transfer{'s' * (gave_up != 1)} given up"] if gave_up else []
    extra += [f"the link probed during {probes} recompute{'s' * (probes != 1)}"] if probes else []
    return ", ".join(parts) + (f"; {', '.join(extra)}" if extra else "")


def print_so(setup, runs, slo):
    """The "So:" lines: what the adaptive policy did (counted from its choices), its outcome, the oracle's,
    and what "always text" trades when it arrives sooner."""
    ad, orc, text = runs["adaptive"], runs["oracle"], runs["always text"]
    met = lambda r: "SLO met" if r.ttft_s <= slo else "SLO MISSED"  # noqa: E731
    say(f"So: adaptive fetched {did(setup, ad)}: TTFT {ad.ttft_s:.2f} s ({met(ad)}), quality {ad.quality:.3f}.")
    say(f"    The oracle, knowing the trace, fetched {did(setup, orc)}: TTFT {orc.ttft_s:.2f} s "
          f"({met(orc)}), quality {orc.quality:.3f}.")
    for name, r in runs.items():
        if name.startswith("always") and name != "always text" and r.ttft_s < ad.ttft_s:
            note = ("both miss the SLO" if r.ttft_s > slo else
                    "it meets the SLO, adaptive does not" if ad.ttft_s > slo else "both meet the SLO")
            say(f"    {name.capitalize()} arrives sooner here ({r.ttft_s:.2f} s vs {ad.ttft_s:.2f} s; {note}): adaptive "
                "chose by the rates it had measured, and the link then changed.")
    if text.ttft_s < ad.ttft_s:
        say(f"    Always text arrives sooner ({text.ttft_s:.2f} s vs {ad.ttft_s:.2f} s) and exact (quality "
              f"{text.quality:.3f}), but the GPUs recompute {text.text_tokens:,} tokens ({text.gpu_s:.2f} s on "
              f"{N_GPUS} GPUs) against adaptive's {ad.text_tokens:,} ({ad.gpu_s:.2f} s): adaptive trades "
              f"{text.quality - ad.quality:.3f} of quality for that GPU time, which the cache exists to save.")


def print_policies(runs, slo, fmt=compact, title=None):
    print(table(["policy", "choices", "TTFT s", f"SLO {slo:g} s", "quality", "recomputed tokens", "GPU s"],
                [[name, fmt(r.choices), f"{r.ttft_s:.2f}", "met" if r.ttft_s <= slo else "MISSED",
                  f"{r.quality:.3f}", f"{r.text_tokens:,}", f"{r.gpu_s:.2f}"] for name, r in runs.items()],
                title=title))


def print_shape(ex, answers="answers"):
    """The handout's expected shape, part by part, against the adaptive run."""
    say(f"handout: {HANDOUT['trace']}", indent=9)
    if ex["drop"] is None:
        print("ours:    the trace has no drop in bandwidth, so the handout's shape cannot appear")
        return
    parts = [k for k in ex["shape"] if k != "complete before the drop"]
    say("ours:    " + "; ".join(f"{k}: {'yes' if ex['shape'][k] else 'NO'}" for k in parts)
          + f" (our {ex['coarsest']} {answers} {ex['coarsest_accuracy']:.1%})", indent=9)


def print_why(ex, trace, codec=True):
    """Two or three lines on why the run looks as it does, all computed (the 1.66x is the handout's)."""
    name = ex["finest"]
    where = "the trace never drops" if ex["drop"] is None else (
        f"{'before' if ex['shape']['complete before the drop'] else 'after'} the drop at {ex['drop'][0]:g} s "
        f"({ex['drop'][1]:g} -> {ex['drop'][2]:g} Gb/s)")
    say(f"Why: at {name} the {ex['context']:,}-token context is {ex['finest_gb']:.3f} GB and arrives "
          f"(always {name}) in {ex['finest_s']:.2f} s, {where}.")
    if codec:
        say(f"  The handout's codec was {HANDOUT['codec_vs_8bit']}x smaller than 8-bit quantization (about "
              f"{ex['handout_bits_per_value']:.1f} bits/value); ours is {ex['vs_8bit']:.1f}x smaller "
              f"({ex['finest_bits_per_value']:.2f} bits/value at {name}): the handout's levels were about "
              f"{ex['handout_over_ours']:.1f}x larger.")
    low = min(trace.gbps)
    say(f"  Text (recompute chunk by chunk, {ex['text_recompute_s']:.2f} s of GPU) beats {ex['coarsest']} only "
          f"below {ex['text_breakeven_gbit']:.2f} Gb/s; the trace's slowest rate is {low:g} Gb/s"
          + (", so text never pays." if low > ex["text_breakeven_gbit"] else "."))


def print_part1(levels, lossless, lossless_src, opts, no_loss, rows, recompute, breakeven, note):
    values = tm.kv_bytes_per_token(MODEL) // 2
    print(f"== Part 1 (§4.1): {tm.MODELS[MODEL].name} on {N_GPUS} x {GPU}, fetching a {CONTEXT:,}-token context")
    print(f"Compressed sizes: each codec level's bits per value, measured by the codec on the record-world\n"
          f"model (256 values/token), applied to {tm.MODELS[MODEL].name}'s {values:,} values/token "
          f"(kv_bytes_per_token / 2).\nText = {st.TEXT_BYTES_PER_TOKEN} B/token of token ids, then recompute "
          f"({recompute:.2f} s for the whole context in one batch, time model).\n"
          f"Lossless accuracy (raw, text) = {lossless:.3f}, {lossless_src}.")
    print(table(["option", "bits/value", "GB / context", "accuracy", "break-even vs text"],
                [[o.name, f"{o.bits_per_value:.2f}" if not o.recompute else "-",
                  f"{o.bits_per_token * CONTEXT / 8e9:.3f}", f"{o.accuracy:.3f}",
                  f"{breakeven[o.name]:.1f} Gb/s" if o.name in breakeven else "-"] for o in opts]))
    print()
    names = [o.name for o in opts]
    print(table(["Gb/s"] + [f"{n} s" for n in names] + ["best (no loss)", "fastest"],
                [[f"{r['gbps']:g}"] + [f"{r['ttft'][n]:.2f}" for n in names] + [r["best"], r["fastest"]]
                 for r in rows],
                title=f"TTFT (context on the GPU), seconds.\n'best' = fastest of {sorted(no_loss)} "
                      f"(within {NO_LOSS_POINTS * 100:.1f} points of lossless)."))
    print(f"handout: {HANDOUT['part1']}")
    vs = [r["vs_8bit"] for r in rows]
    finest = next(o.name for o in opts if not o.recompute and o.name != "raw")
    say(f"§4.1 headline: CacheGen fetches and processes a context {HANDOUT['cachegen_delay']} faster than the "
        f"8-bit quantization baseline (LLaMA, measured end to end). Ours, 8-bit KV TTFT / {finest} TTFT over "
        f"{BANDWIDTHS[0]:g}-{BANDWIDTHS[-1]:g} Gb/s: " + (f"{min(vs):.1f}x" if f"{min(vs):.1f}" == f"{max(vs):.1f}"
                                                          else f"{min(vs):.1f}-{max(vs):.1f}x")
        + f". With the transfer alone in the model it is the size ratio, 8 bits over {finest}'s "
        f"{next(o.bits_per_value for o in opts if o.name == finest):.2f} bits per value (a record-world level); "
        "CacheGen's figure also pays decoding, and its levels were fitted on LLaMA.")
    print()
    say(f"Note (§4.1, pitfall 1): {tm.MODELS[NOTE_MODEL].name} on one {NOTE_GPU} recomputes {CONTEXT:,} tokens in "
          f"{note['recompute_s']:.2f} s (handout {HANDOUT['8b_recompute_s']} s; the time model's anchor).")
    say(f"  raw KV ({tm.kv_bytes_per_token(NOTE_MODEL) // K} KiB/token) beats recomputing only above "
          f"{note['raw_breakeven_gbit']:.1f} Gb/s; handout: below {HANDOUT['8b_breakeven_gbit']} Gb/s every link loses.")
    say(f"  {HANDOUT['8b_breakeven_gbit']} Gb/s is the break-even of KV compressed {note['compression_for_handout']:.2f}x "
          f"({16 / note['compression_for_handout']:.1f} bits/value); with the codec's levels: "
          + ", ".join(f"{k} {v:.1f} Gb/s" for k, v in note["levels_breakeven_gbit"].items()) + ".")


def print_chunks(setup, run):
    """One row per chunk of an adaptive run: what it expected, chose, and got."""
    rows = []
    for i, (r, (first, n)) in enumerate(zip(run.rows, setup.plan)):
        choice = r["choice"] + (f" ({r['gave_up']} given up)" if r.get("gave_up") else "")
        measured = "-" if r["measured_gbps"] is None else f"{r['measured_gbps']:.2f}" + (" (probe)" if r.get("probe") else "")
        rows.append([i, f"{first:,}-{first + n - 1:,}", f"{r['start']:.3f}", f"{r['est_gbps']:.2f}",
                     f"{r['budget_s']:.3f}", choice, f"{r['predicted']:.3f}", f"{r['finish']:.3f}", measured])
    print(table(["chunk", "tokens", "start s", "est Gb/s", "budget s", "choice", "predicted s", "finish s",
                 "measured Gb/s"], rows))


def print_part2(setup, runs, steady, trace, slo, chunk_tokens):
    print()
    segs = ", ".join(f"{g:g} Gb/s from {t:g} s" for t, g in zip(trace.times, trace.gbps))
    print(f"== Part 2 (§4.2): adaptive streaming, chunks of {chunk_tokens:,} tokens, SLO {slo:g} s")
    print(f"Trace: {segs}.")
    print("Each chunk: the throughput measured on the previous chunk is assumed to hold; its budget is its token\n"
          "share of the time left; it takes the finest level predicted to fit, else text (recompute on the GPU,\n"
          "attending to the KV received), else the fastest option. The link is idle while the GPU recomputes: a\n"
          "probe measures it then, so a link that recovers is seen. A KV chunk still arriving when only all-text\n"
          "could meet the SLO is given up and recomputed. Configurations: the codec's levels (each chunk encoded\n"
          "offline at every level) and text; raw FP16 KV is not streamed (CacheGen streams its levels only).")
    print_chunks(setup, runs["adaptive"])
    ex = explain(setup, runs, trace)
    print_shape(ex)
    print_why(ex, trace)
    print()
    print_policies(runs, slo, title="Whole context: quality = token-weighted accuracy (text chunks exact); GPU s = "
                   f"recompute time on {N_GPUS} GPUs.\nThe oracle knows the trace: meet the SLO, then recompute "
                   "least, then lose least.")
    print_so(setup, runs, slo)
    print(f"\nSteady {STEADY_GBPS:g} Gb/s: {compact(steady.choices)} (TTFT {steady.ttft_s:.2f} s); "
          f"handout: {HANDOUT['steady']}")


def print_part2_long(setup, runs, trace, slo):
    print()
    print(f"== Part 2b (§4.2's trace and SLO, a longer context; not in the handout): {setup.context_tokens:,} tokens\n"
          f"(--long-context; LLaMA-3.1 reads up to {MAX_CONTEXT // K}K)")
    print_policies(runs, slo, fmt=runs_of)
    ex = explain(setup, runs, trace)
    print_shape(ex)
    print_why(ex, trace, codec=False)
    print_so(setup, runs, slo)


def print_part2_real(levels, setup, runs, steady, trace, slo):
    print()
    print(f"== Part 2c (§4.2 with real levels): Part 2 again, the codec's levels measured on a real LLaMA\n(SmolLM2-135M; codec_real.py, "
          f"the same codec with its steps searched under a KL budget of {cr.REAL_MAX_KL} nats/token on prose)")
    kv_opts = [o for o in setup.options if not o.recompute]          # the levels, finest first
    lvs = sorted(levels, key=lambda d: d["level"])
    pm = lambda x, se, f: f"{x:{f}} +- {se:{f.lstrip('+')}}" if se == se else f"{x:{f}}"  # noqa: E731  (nan: no noise known)
    print(table(["level", "bits/value", "GB / context", "KL from FP16", "top-1 = FP16's", "KL step", "top-1 step"],
                [[o.name, f"{o.bits_per_value:.2f}", f"{o.bits_per_token * setup.context_tokens / 8e9:.3f}",
                  pm(lv["kl"], lv.get("kl_se", float("nan")), ".4f"),
                  pm(100 * o.accuracy, 100 * lv.get("agree_se", float("nan")), ".1f") + "%",
                  pm(lv["kl_step"], lv["kl_step_se"], "+.4f") if "kl_step" in lv else "",
                  pm(100 * lv["agree_step"], 100 * lv["agree_step_se"], "+.1f") if "agree_step" in lv else ""]
                 for o, lv in zip(kv_opts, lvs)],
                title=f"Measured on {lvs[0]['positions']:,} next-token positions of evaluation prose"
                      + (f" ({lvs[0]['paragraphs']} paragraphs; +- one standard error over paragraphs;\nstep: "
                         "the paired change from the finer level, each paragraph scored at both)."
                         if "paragraphs" in lvs[0] else ".")))
    steps = [lv for lv in lvs[1:] if "agree_step" in lv]
    if steps:
        kl_clear = all(lv["kl_step"] > 2 * lv["kl_step_se"] for lv in steps)
        unclear = [f"level{lv['level']}" for lv in steps if abs(lv["agree_step"]) <= 2 * lv["agree_step_se"]]
        say(f"KL grows level by level {'beyond' if kl_clear else 'NOT beyond'} two standard errors; top-1 agreement "
            + (f"changes within two standard errors at {', '.join(unclear)}: a coarser level can score as well "
               "or better there by chance, so KL is the measure to trust." if unclear else
               "falls level by level beyond two standard errors."))
    print_chunks(setup, runs["adaptive"])
    ex = explain(setup, runs, trace)
    print_shape(ex, answers="agrees with FP16's next token")
    print_why(ex, trace, codec=False)
    print()
    print_policies(runs, slo, title="Whole context: quality = token-weighted share of next tokens equal to FP16's "
                                    "(text chunks exact).")
    print_so(setup, runs, slo)
    print(f"\nSteady {STEADY_GBPS:g} Gb/s: {compact(steady.choices)} (TTFT {steady.ttft_s:.2f} s); "
          f"handout: {HANDOUT['steady']}")


def print_part3(rows, slo, trace, half=HALF_EFFICIENCY_TOKENS):
    print()
    print(f"== Part 3 (§4.2): chunk size on the same trace. Recompute of a chunk of n tokens runs\n"
          f"(1 + {half:g}/n) / (1 + {half:g}/12K) times slower than the time model (a batch of n tokens at "
          f"n/(n+{half:g}) of large-batch speed;\nan assumption, --half-tokens, see streaming.batch_slowdown).")
    print(table(["chunk", "chunks", "slowdown", "all-text s", "overrun s", "TTFT s", "SLO", "quality", "GPU s",
                 "oracle s", "oracle q"],
                [[f"{r['chunk_tokens']:,}", r["chunks"], f"{r['slowdown']:.3f}", f"{r['text_ttft_s']:.2f}",
                  f"{r['overrun_s']:.2f}", f"{r['adaptive'].ttft_s:.2f}",
                  "met" if r["adaptive"].ttft_s <= slo else "MISSED", f"{r['adaptive'].quality:.3f}",
                  f"{r['adaptive'].gpu_s:.2f}", f"{r['oracle'].ttft_s:.2f}", f"{r['oracle'].quality:.3f}"]
                 for r in rows],
                title="chunk: tokens per chunk; slowdown: recompute of one chunk vs the time model; all-text s: TTFT with\n"
                      "every chunk recomputed (small batches cost); overrun s: the worst chunk's finish minus its predicted\n"
                      "finish (large chunks react late); TTFT ... GPU s: the adaptive policy; oracle s, q: the oracle's "
                      "TTFT, quality."))
    for r in rows:
        say(f"adaptive's choices, {r['chunk_tokens']:,}-token chunks: {runs_of(r['adaptive'].choices)}")
    print(f"handout: {HANDOUT['chunks']}")
    text = [r["text_ttft_s"] for r in rows]
    late = max(rows, key=lambda r: r["overrun_s"])
    drop = first_drop(trace)
    early = drop is not None and all(r["adaptive"].ttft_s <= drop[0] for r in rows)
    print(f"ours:    small batches cost: all-text TTFT {min(text):.2f}-{max(text):.2f} s across chunk sizes;")
    say("         " + (f"reacting late: worst overrun {late['overrun_s']:.2f} s with {late['chunk_tokens']:,}-token chunks"
             if late["overrun_s"] > 1e-9 else
             "reacting late costs nothing here: no chunk ran past its predicted finish"
             + (f" (at every size the context is in before the drop at {drop[0]:g} s)" if early else "")), indent=9)


def print_part4(traces, cells, slo, chunk_tokens, seed):
    print()
    print(f"== Part 4 (§4.2 on many traces, as CacheGen's evaluation replays throughput traces): {len(traces)} traces, "
          f"seed {seed},\nSLO {slo:g} s, chunks of {chunk_tokens:,} tokens. Each trace: a Markov chain over "
          f"{', '.join(f'{g:g}' for g in SUITE_GBPS)} Gb/s,\neach rate held {SUITE_DWELL_S[0]:g}-{SUITE_DWELL_S[1]:g} s, "
          f"then a neighbouring rate (or any rate, chance {SUITE_JUMP:g}).")
    rows = []
    for c in cells:
        for p in SUITE_SHOWN:
            m = c["summary"][p]
            rows.append([f"{c['levels']} {c['context'] // K}K", p, f"{m['violation_rate']:.1%}", f"{m['mean_ttft_s']:.2f}",
                         f"{m['p95_ttft_s']:.2f}", f"{m['mean_quality']:.4f}", f"{m['mean_quality_on_time']:.4f}",
                         f"{m['mean_text_tokens']:,.0f}"])
    print(table(["levels, context", "policy", "SLO missed", "mean TTFT s", "p95 TTFT s", "quality",
                 "on-time quality", "recomputed tokens"], rows,
                title="quality: of what arrived, late or not; on-time quality: a context past the SLO counts 0. "
                      "naive adaptive: the\nsame rule keeping its last KV measurement through text and waiting for "
                      "every KV chunk (no probe, no give-up)."))
    print("The promise, per levels and context: wherever always level0 or always text meets the SLO, adaptive does;")
    print("its SLO-miss rate is at most the best fixed policy's; its on-time quality at least always level0's.")
    for c in cells:
        ad, l0 = c["summary"]["adaptive"], c["summary"]["always level0"]
        best = c["summary"][c["best_fixed"]]
        ex = c["exceptions"]
        say(f"  {c['levels']} {c['context'] // K}K: broken on {len(ex)} of {len(traces)} traces; misses "
              f"{ad['violation_rate']:.1%} vs {c['best_fixed']}'s {best['violation_rate']:.1%}: "
              f"{'yes' if c['rate_ok'] else 'NO'}; on-time quality {ad['mean_quality_on_time']:.4f} vs "
              f"{l0['mean_quality_on_time']:.4f}: {'yes' if c['quality_on_time_ok'] else 'NO'}")
        for e in ex[:SUITE_EXCEPTIONS_SHOWN]:
            print(f"    trace {e['trace']}: {' and '.join(e['fixed_met'])} met it, adaptive took {e['adaptive_ttft_s']:.2f} s: "
                  f"chunk {e['chunk']} ({e['choice']}) was due at {e['predicted_s']:.2f} s at {e['est_gbps']:.2f} "
                  f"Gb/s,\n      ended at {e['finish_s']:.2f} s (the link fell to {e['lowest_gbps']:g} Gb/s)")
        if len(ex) > SUITE_EXCEPTIONS_SHOWN:
            print(f"    ... and {len(ex) - SUITE_EXCEPTIONS_SHOWN} more (--json lists them all)")
        if ad["mean_quality"] < l0["mean_quality"]:
            print(f"    quality of what arrived: adaptive {ad['mean_quality']:.4f} < always level0's "
                  f"{l0['mean_quality']:.4f}: the coarser levels it takes to arrive in time")


# ----------------------------------------------------------------------------------------- figures
COLORS = {"level0": "#1a9850", "level1": "#91cf60", "level2": "#fee08b", "level3": "#fc8d59",
          "text": "#4575b4", "raw": "#999999"}


def plot(opts, rows, runs, trace, slo):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    g = [r["gbps"] for r in rows]
    for o in opts:
        ax.plot(g, [r["ttft"][o.name] for r in rows], marker="o", ms=3, color=COLORS.get(o.name),
                label=f"{o.name} (acc {o.accuracy:.2f})")
    ax.set(xscale="log", yscale="log", xlabel="link bandwidth, Gb/s", ylabel="TTFT (context on GPU), s",
           title=f"{tm.MODELS[MODEL].name}, {N_GPUS} x {GPU}, {CONTEXT // K}K-token context")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p1 = figure_path("03_ttft_vs_bandwidth.png")
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    p2 = figure_path("03_trace_choices.png")
    plot_trace(runs, trace, slo, p2, "Trace and each chunk's choice (record-world levels)")
    return [p1, p2]


def plot_trace(runs, trace, slo, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(max(r.ttft_s for r in runs.values()), slo) * 1.05
    fig, (top, bot) = plt.subplots(2, 1, figsize=(8, 5), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
    ts = list(trace.times) + [end]
    top.step(ts, list(trace.gbps) + [trace.gbps[-1]], where="post", color="k")
    top.set(ylabel="link, Gb/s", ylim=(0, max(trace.gbps) * 1.1))
    top.set_title(title, fontsize=9)
    for i, (name, r) in enumerate(runs.items()):
        for row in r.rows:
            bot.barh(i, row["finish"] - row["start"], left=row["start"], color=COLORS.get(row["choice"]),
                     edgecolor="k", lw=0.5)
            if row["finish"] - row["start"] > 0.08:
                bot.text((row["start"] + row["finish"]) / 2, i, SHORT[row["choice"]], ha="center", va="center", fontsize=7)
    bot.set_yticks(range(len(runs)), list(runs))
    bot.invert_yaxis()
    for a in (top, bot):
        a.axvline(slo, color="r", ls="--", lw=1)
    bot.set(xlabel="time, s (red: SLO)", xlim=(0, end))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_suite(cells, slo, path):
    """CDF of TTFT over the suite, one panel per level set and context, one line per policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"adaptive": ("C3", "-"), "naive adaptive": ("C3", ":"), "always level0": ("#1a9850", "-"),
              "always text": ("#4575b4", "-"), "oracle": ("k", "--")}
    names = list(dict.fromkeys(c["levels"] for c in cells))
    fig, axes = plt.subplots(len(names), len(SUITE_CONTEXTS), figsize=(4.2 * len(SUITE_CONTEXTS), 3.2 * len(names)),
                             squeeze=False, sharex=True)
    for c in cells:
        ax = axes[names.index(c["levels"])][SUITE_CONTEXTS.index(c["context"])]
        for p, runs in c["runs"].items():
            xs = sorted(r.ttft_s for r in runs)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=styles[p][0],
                    ls=styles[p][1], label=p)
        ax.axvline(slo, color="0.5", ls="--", lw=1)
        ax.set(xscale="log", title=f"{c['levels']} levels, {c['context'] // K}K tokens", ylim=(0, 1.02))
        ax.grid(alpha=0.3, which="both")
    for ax in axes[-1]:
        ax.set_xlabel("TTFT (context on GPU), s (grey dashes: SLO)")
    for row in axes:
        row[0].set_ylabel("share of traces")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def suite_json(traces, cells, slo, seed) -> dict:
    return {"traces": len(traces), "seed": seed, "slo_s": slo, "contexts": SUITE_CONTEXTS,
            "cells": [{"levels": c["levels"], "context": c["context"], "policies": c["summary"],
                       "best_fixed": c["best_fixed"], "rate_ok": c["rate_ok"],
                       "quality_on_time_ok": c["quality_on_time_ok"], "exceptions": c["exceptions"]}
                      for c in cells]}


def policy_json(runs) -> dict:
    return {name: {"choices": r.choices, "ttft_s": r.ttft_s, "quality": r.quality, "text_tokens": r.text_tokens,
                   "gpu_s": r.gpu_s} for name, r in runs.items()}


# -------------------------------------------------------------------------------------------- main
def parse(argv):
    p = Parser(__doc__)
    p.add_argument("--trace", metavar="FILE", help="CSV 'time_s,gbit_per_s' per line (rate from that time on); "
                                                   "default: the TRACE constant (§4.2)")
    p.add_argument("--slo", type=positive_float, default=SLO, help="seconds until the context must be on the GPU")
    p.add_argument("--chunk-tokens", type=positive_int, default=CHUNK_TOKENS, help="tokens per chunk (Part 2)")
    p.add_argument("--long-context", type=positive_int, default=LONG_CONTEXT,
                   help=f"tokens of context in Part 2b (at most {MAX_CONTEXT}, LLaMA-3.1's window)")
    p.add_argument("--levels", metavar="FILE", help="JSON list of codec levels instead of codec_study.codec_levels()")
    p.add_argument("--half-tokens", type=positive_float, default=HALF_EFFICIENCY_TOKENS,
                   help="recompute batch size that runs at half speed (the small-batch assumption)")
    p.add_argument("--trace-suite", type=nonneg_int, default=SUITE_TRACES, metavar="N",
                   help="Part 4: N random traces (0: skip)")
    p.add_argument("--suite-seed", type=nonneg_int, default=SUITE_SEED, help="the trace suite's random seed")
    p.add_argument("--no-real", action="store_true", help="skip Part 2c (levels measured on SmolLM2)")
    a = p.parse_args(argv)
    if a.chunk_tokens > CONTEXT:
        p.error(f"argument --chunk-tokens: at most the context, {CONTEXT}")
    if a.long_context > MAX_CONTEXT:
        p.error(f"argument --long-context: at most {MAX_CONTEXT} (LLaMA-3.1's context window)")
    return a


def compute(a) -> dict:
    """Every Part's numbers: the levels, Parts 1-3, Part 2c's real levels if SmolLM2 is at hand, Part 4."""
    trace, levels = load_trace(a.trace), load_levels(a.levels)
    lossless, lossless_src = lossless_accuracy(levels)
    half = a.half_tokens
    r = {"trace": trace, "levels": levels, "lossless": lossless, "lossless_src": lossless_src,
         "part1": part1(levels, lossless, BANDWIDTHS, half), "note": note_8b(levels),
         "part2": part2(levels, lossless, trace, a.slo, a.chunk_tokens, half),
         "long": part2_long(levels, lossless, trace, a.slo, a.chunk_tokens, a.long_context, half),
         "sizes": part3(levels, lossless, trace, a.slo, CHUNK_SIZES, half), "real": None, "suite": None}
    if not a.no_real and smollm2_or_explain(say=lambda msg: print(f"Part 2c skipped: {msg}")) is not None:
        real_levels = cr.real_codec_levels()  # fits the codec on SmolLM2 on first use (about a minute)
        r["real"] = (real_levels, *part2(real_levels, 1.0, trace, a.slo, a.chunk_tokens, half))
    if a.trace_suite:
        sets = {"record-world" if a.levels is None else Path(a.levels).name: (levels, lossless)}
        sets |= {"SmolLM2": (r["real"][0], 1.0)} if r["real"] else {}
        r["suite"] = part4(sets, a.trace_suite, a.suite_seed, a.slo, a.chunk_tokens, half)
    return r


def report(r, a):
    print_part1(r["levels"], r["lossless"], r["lossless_src"], *r["part1"], r["note"])
    print_part2(*r["part2"], r["trace"], a.slo, a.chunk_tokens)
    print_part2_long(*r["long"], r["trace"], a.slo)
    if r["real"]:
        print_part2_real(*r["real"], r["trace"], a.slo)
    print_part3(r["sizes"], a.slo, r["trace"], a.half_tokens)
    if r["suite"]:
        print_part4(*r["suite"], a.slo, a.chunk_tokens, a.suite_seed)


def figures(r, a):
    opts, _, rows, _, _ = r["part1"]
    _, runs, _ = r["part2"]
    trace, real = r["trace"], r["real"]
    paths = plot(opts, rows, runs, trace, a.slo)
    long_setup, long_runs = r["long"]
    paths.append(figure_path("03_trace_choices_long.png"))
    ad, l0 = long_runs["adaptive"], long_runs["always level0"]
    plot_trace(long_runs, trace, a.slo, paths[-1],
               f"Part 2b, {long_setup.context_tokens // K}K tokens: adaptive coarsens after the drop\n"
               f"(TTFT {ad.ttft_s:.2f} s vs always level0 {l0.ttft_s:.2f} s; SLO {a.slo:g} s)")
    if real:
        paths.append(figure_path("03_trace_choices_smollm2_levels.png"))
        plot_trace(real[2], trace, a.slo, paths[-1], "Trace and each chunk's choice, levels measured on SmolLM2")
    if r["suite"]:
        paths.append(figure_path("03_trace_suite_ttft_cdf.png"))
        plot_suite(r["suite"][1], a.slo, paths[-1])
    for path in paths:
        print(f"figure: {path}")


def to_json(r, a) -> dict:
    opts, _, rows, recompute, breakeven = r["part1"]
    _, runs, steady = r["part2"]
    _, long_runs = r["long"]
    note, real, suite, trace = r["note"], r["real"], r["suite"], r["trace"]
    ad = runs["adaptive"]
    return {
        "best_at_gbit_per_s": {f"{x['gbps']:g}": x["best"] for x in rows},
        "fastest_at_gbit_per_s": {f"{x['gbps']:g}": x["fastest"] for x in rows},
        "ttft_s_at_gbit_per_s": {f"{x['gbps']:g}": x["ttft"] for x in rows},
        "vs_8bit_at_gbit_per_s": {f"{x['gbps']:g}": x["vs_8bit"] for x in rows},
        "breakeven_gbit_per_s": breakeven,
        "llama31_70b_12k_recompute_s": recompute,
        "levels_bits_per_value": {o.name: o.bits_per_value for o in opts if not o.recompute},
        "llama31_8b_12k_recompute_s": note["recompute_s"],
        "llama31_8b_raw_breakeven_gbit_per_s": note["raw_breakeven_gbit"],
        "llama31_8b_compression_for_25gbit": note["compression_for_handout"],
        "trace_choices": ad.choices,
        "trace_ttft_s": ad.ttft_s,
        "trace_quality": ad.quality,
        "trace_rows": ad.rows,
        "policies": policy_json(runs),
        "steady25_choices": steady.choices,
        "long_trace_choices": long_runs["adaptive"].choices,
        "long_trace_ttft_s": long_runs["adaptive"].ttft_s,
        "long_policies": policy_json(long_runs),
        **({"real_levels": real[0], "real_trace_choices": real[2]["adaptive"].choices,
            "real_trace_ttft_s": real[2]["adaptive"].ttft_s, "real_trace_quality": real[2]["adaptive"].quality,
            "real_steady25_choices": real[3].choices,
            "real_policies": policy_json(real[2])} if real else {}),
        "chunk_sizes": {str(x["chunk_tokens"]): {"ttft_s": x["adaptive"].ttft_s, "quality": x["adaptive"].quality,
                                                 "slo_met": x["adaptive"].ttft_s <= a.slo,
                                                 "choices": x["adaptive"].choices,
                                                 "oracle_ttft_s": x["oracle"].ttft_s,
                                                 "oracle_quality": x["oracle"].quality,
                                                 "all_text_ttft_s": x["text_ttft_s"],
                                                 "worst_overrun_s": x["overrun_s"]} for x in r["sizes"]},
        **({"suite": suite_json(*suite, a.slo, a.suite_seed)} if suite else {}),
        "setup": {"model": MODEL, "gpu": GPU, "n_gpus": N_GPUS, "context": CONTEXT, "slo_s": a.slo,
                  "chunk_tokens": a.chunk_tokens, "long_context": a.long_context, "half_tokens": a.half_tokens,
                  "trace": list(zip(trace.times, trace.gbps))},
    }


def main(argv=None):
    a = parse(argv)
    r = compute(a)
    report(r, a)
    if not a.no_plot:
        figures(r, a)
    write_json(a.json, to_json(r, a))


if __name__ == "__main__":
    main()

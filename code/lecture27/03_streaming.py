"""03 -- CacheGen part two (handout §4): when to send KV and when to send text, and adapting to a link
whose bandwidth changes while a context streams in.

    python code/lecture27/03_streaming.py                       # Parts 1-3, two figures
    python code/lecture27/03_streaming.py --json out.json       # + headline figures as JSON
    python code/lecture27/03_streaming.py --trace my.csv --slo 3 --chunk-tokens 1024

Part 1 (§4.1, pitfall 1): LLaMA-3.1-70B on 4 x A100 fetching a 12K-token context over a steady link:
        time to first token sending text (then recomputing), raw KV, or KV at each codec level; the
        8B-on-H100 note.
Part 2 (§4.2): the adaptive policy chunk by chunk on a trace (10 -> 1 -> 5 Gb/s, SLO 4 s), against
        always-finest, always-text and an oracle that knows the trace; a steady 25 Gb/s link.
Part 3 (§4.2): the chunk-size trade-off on the same trace.
The codec's four levels come from kvcache.codec_levels() (measured by 02 on the record-world model);
the simulation, the policy and the oracle are in streaming.py. Recompute times: common/timemodel.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvcache as kv  # noqa: E402
import streaming as st  # noqa: E402
from common import timemodel as tm  # noqa: E402
from common.cli import Parser, fail, figure_path, positive_float, positive_int, table, write_json  # noqa: E402

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
# ---- Part 3 (§4.2)
CHUNK_SIZES = [512, 1536, 3072, 6144]                  # about 0.5K, 1.5K, 3K, 6K tokens
HALF_EFFICIENCY_TOKENS = st.HALF_EFFICIENCY_TOKENS     # recompute batch at half speed (assumption, streaming.py)

# The handout's statements, printed beside ours (reference only; nothing is computed from them)
HANDOUT = {
    "part1": "text wins at low bandwidth, compressed KV at high",
    "8b_recompute_s": 0.36, "8b_breakeven_gbit": 25,
    "trace": "finest level while the link is good, text after the drop, a coarser level at the end "
             "chosen by the time left (this small model's level 3 answers only 74%)",
    "steady": "the finest level throughout",
    "chunks": "large chunks react late; small chunks recompute in small GPU batches",
}
SHORT = {"text": "T", "raw": "R", "level0": "L0", "level1": "L1", "level2": "L2", "level3": "L3"}


# ------------------------------------------------------------------------------------------ inputs
def load_levels(path: str | None) -> list[dict]:
    """The codec's levels: kvcache.codec_levels() (measured by 02, cached), or a JSON file of
    [{"level", "bits_per_value", "accuracy"}, ...] (for exercises and tests)."""
    if path is None:
        try:
            return kv.codec_levels()
        except (AttributeError, NotImplementedError) as e:   # the codec (issue 5) or its model is missing
            print(f"03_streaming.py: the codec's levels are not available ({e}); "
                  f"pass --levels FILE meanwhile", file=sys.stderr)
            sys.exit(1)
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
def part1(levels, lossless, bandwidths):
    opts = st.kv_options(levels, MODEL, lossless, with_raw=True)
    no_loss = {o.name for o in opts if o.accuracy >= lossless - NO_LOSS_POINTS}
    rows = []
    for g in bandwidths:
        ttft = st.whole_context_ttft(MODEL, GPU, N_GPUS, CONTEXT, g, opts)
        rows.append({"gbps": g, "ttft": ttft, "fastest": min(ttft, key=ttft.get),
                     "best": min(no_loss, key=ttft.get)})
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


def part2(levels, lossless, trace, slo, chunk_tokens):
    setup = st.make_setup(MODEL, GPU, N_GPUS, CONTEXT, chunk_tokens, levels, lossless)
    finest = setup.options[0].name
    runs = {"adaptive": st.adaptive(setup, trace, slo), f"always {finest}": st.fixed(setup, trace, finest),
            "always text": st.fixed(setup, trace, "text"), "oracle": st.oracle(setup, trace, slo)}
    steady = st.adaptive(setup, st.Trace.steady(STEADY_GBPS), slo)
    return setup, runs, steady


def part3(levels, lossless, trace, slo, sizes):
    rows = []
    for n in sizes:
        setup = st.make_setup(MODEL, GPU, N_GPUS, CONTEXT, n, levels, lossless)
        ad = st.adaptive(setup, trace, slo)
        rows.append({"chunk_tokens": n, "chunks": len(setup.plan), "slowdown": st.batch_slowdown(n),
                     "adaptive": ad, "oracle": st.oracle(setup, trace, slo),
                     "text_ttft_s": st.fixed(setup, trace, "text").ttft_s,
                     # reacting late: how far past its predicted finish the worst chunk ran
                     "overrun_s": max(r["finish"] - r["predicted"] for r in ad.rows)})
    return rows


# ---------------------------------------------------------------------------------------- printing
def compact(choices):
    return " ".join(SHORT.get(c, c) for c in choices)


def print_part1(levels, lossless, lossless_src, opts, no_loss, rows, recompute, breakeven, note):
    values = tm.kv_bytes_per_token(MODEL) // 2
    print(f"== Part 1 (§4.1): {tm.MODELS[MODEL].name} on {N_GPUS} x {GPU}, fetching a {CONTEXT:,}-token context")
    print(f"Compressed sizes: each codec level's bits per value, measured by the codec on the record-world\n"
          f"model (256 values/token), applied to {tm.MODELS[MODEL].name}'s {values:,} values/token "
          f"(kv_bytes_per_token / 2).\nText = {st.TEXT_BYTES_PER_TOKEN} B/token of token ids, then recompute "
          f"({recompute:.2f} s for the whole context in one batch, time model).\n"
          f"Lossless accuracy (raw, text) = {lossless:.3f}, {lossless_src}.")
    print(table(["option", "bits/value", "GB / context", "accuracy", "break-even vs text"],
                [[o.name, f"{o.bits_per_token / values:.2f}" if not o.recompute else "-",
                  f"{o.bits_per_token * CONTEXT / 8e9:.3f}", f"{o.accuracy:.3f}",
                  f"{breakeven[o.name]:.1f} Gb/s" if o.name in breakeven else "-"] for o in opts]))
    print()
    names = [o.name for o in opts]
    print(table(["Gb/s"] + [f"{n} s" for n in names] + ["best (no loss)", "fastest"],
                [[f"{r['gbps']:g}"] + [f"{r['ttft'][n]:.2f}" for n in names] + [r["best"], r["fastest"]]
                 for r in rows],
                title=f"TTFT (context on the GPU), seconds. 'best' = fastest of {sorted(no_loss)} "
                      f"(within {NO_LOSS_POINTS * 100:.1f} points of lossless)."))
    print(f"handout: {HANDOUT['part1']}")
    print()
    print(f"Note (§4.1, pitfall 1): {tm.MODELS[NOTE_MODEL].name} on one {NOTE_GPU} recomputes {CONTEXT:,} tokens in "
          f"{note['recompute_s']:.2f} s (handout {HANDOUT['8b_recompute_s']} s; the time model's anchor).")
    print(f"  raw KV ({tm.kv_bytes_per_token(NOTE_MODEL) // K} KiB/token) beats recomputing only above "
          f"{note['raw_breakeven_gbit']:.1f} Gb/s; handout: below {HANDOUT['8b_breakeven_gbit']} Gb/s every link loses.")
    print(f"  {HANDOUT['8b_breakeven_gbit']} Gb/s is the break-even of KV compressed {note['compression_for_handout']:.2f}x "
          f"({16 / note['compression_for_handout']:.1f} bits/value); with the codec's levels: "
          + ", ".join(f"{k} {v:.1f} Gb/s" for k, v in note["levels_breakeven_gbit"].items()) + ".")


def print_part2(setup, runs, steady, trace, slo, chunk_tokens):
    print()
    segs = ", ".join(f"{g:g} Gb/s from {t:g} s" for t, g in zip(trace.times, trace.gbps))
    print(f"== Part 2 (§4.2): adaptive streaming, chunks of {chunk_tokens:,} tokens, SLO {slo:g} s; trace: {segs}")
    print("Each chunk: the throughput measured on the previous KV chunk is assumed to hold; its budget is its token\n"
          "share of the time left; it takes the finest level predicted to fit, else text (recompute on the GPU,\n"
          "attending to the KV received), else the fastest option. No overlap: the link waits while the GPU recomputes.\n"
          "Configurations: the codec's levels (each chunk encoded offline at every level) and text; raw FP16 KV is\n"
          "not streamed (CacheGen streams its levels only).")
    a = runs["adaptive"]
    rows = []
    for i, (r, (first, n)) in enumerate(zip(a.rows, setup.plan)):
        rows.append([i, f"{first:,}-{first + n - 1:,}", f"{r['start']:.3f}", f"{r['est_gbps']:.2f}",
                     f"{r['budget_s']:.3f}", r["choice"], f"{r['predicted']:.3f}", f"{r['finish']:.3f}",
                     f"{r['measured_gbps']:.2f}" if r["measured_gbps"] is not None else "- (text)"])
    print(table(["chunk", "tokens", "start s", "est Gb/s", "budget s", "choice", "predicted s", "finish s",
                 "measured Gb/s"], rows))
    print(f"handout: {HANDOUT['trace']}")
    print()
    print(table(["policy", "choices", "TTFT s", f"SLO {slo:g} s", "quality", "recomputed tokens", "GPU s"],
                [[name, compact(r.choices), f"{r.ttft_s:.2f}", "met" if r.ttft_s <= slo else "MISSED",
                  f"{r.quality:.3f}", f"{r.text_tokens:,}", f"{r.gpu_s:.2f}"] for name, r in runs.items()],
                title="Whole context: quality = token-weighted accuracy (text chunks exact); GPU s = recompute time "
                      f"on {N_GPUS} GPUs.\nThe oracle knows the trace: meet the SLO, then recompute least, then lose least."))
    print(f"\nSteady {STEADY_GBPS:g} Gb/s: {compact(steady.choices)} (TTFT {steady.ttft_s:.2f} s); "
          f"handout: {HANDOUT['steady']}")


def print_part3(rows, slo):
    print()
    print(f"== Part 3 (§4.2): chunk size on the same trace. Recompute of a chunk of n tokens runs "
          f"(1 + {HALF_EFFICIENCY_TOKENS}/n) / (1 + {HALF_EFFICIENCY_TOKENS}/12K) times slower than the time model\n"
          f"(a batch of n tokens at n/(n+{HALF_EFFICIENCY_TOKENS}) of large-batch speed; an assumption, see streaming.batch_slowdown).")
    print(table(["chunk tokens", "chunks", "slowdown", "all-text TTFT s", "worst overrun s", "TTFT s", "SLO",
                 "quality", "GPU s", "oracle TTFT s", "oracle quality", "adaptive choices"],
                [[f"{r['chunk_tokens']:,}", r["chunks"], f"{r['slowdown']:.3f}", f"{r['text_ttft_s']:.2f}",
                  f"{r['overrun_s']:.2f}", f"{r['adaptive'].ttft_s:.2f}",
                  "met" if r["adaptive"].ttft_s <= slo else "MISSED", f"{r['adaptive'].quality:.3f}",
                  f"{r['adaptive'].gpu_s:.2f}", f"{r['oracle'].ttft_s:.2f}", f"{r['oracle'].quality:.3f}",
                  compact(r["adaptive"].choices)] for r in rows],
                title="slowdown: recompute of one chunk vs the time model; all-text TTFT: every chunk recomputed (small\n"
                      "batches cost); worst overrun: a chunk's finish minus its predicted finish (large chunks react late);\n"
                      "TTFT ... choices: the adaptive policy."))
    print(f"handout: {HANDOUT['chunks']}")


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

    end = max(max(r.ttft_s for r in runs.values()), slo) * 1.05
    fig, (top, bot) = plt.subplots(2, 1, figsize=(8, 5), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
    ts = list(trace.times) + [end]
    top.step(ts, list(trace.gbps) + [trace.gbps[-1]], where="post", color="k")
    top.set(ylabel="link, Gb/s", ylim=(0, max(trace.gbps) * 1.1), title="Trace and each chunk's choice")
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
    p2 = figure_path("03_trace_choices.png")
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


# -------------------------------------------------------------------------------------------- main
def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("--trace", metavar="FILE", help="CSV 'time_s,gbit_per_s' per line (rate from that time on); "
                                                   "default: the TRACE constant (§4.2)")
    p.add_argument("--slo", type=positive_float, default=SLO, help="seconds until the context must be on the GPU")
    p.add_argument("--chunk-tokens", type=positive_int, default=CHUNK_TOKENS, help="tokens per chunk (Part 2)")
    p.add_argument("--levels", metavar="FILE", help="JSON list of codec levels instead of kvcache.codec_levels()")
    p.add_argument("--no-plot", action="store_true", help="skip the figures")
    a = p.parse_args(argv)
    if a.chunk_tokens > CONTEXT:
        p.error(f"argument --chunk-tokens: at most the context, {CONTEXT}")
    trace = load_trace(a.trace)
    levels = load_levels(a.levels)
    lossless, lossless_src = lossless_accuracy(levels)

    opts, no_loss, rows, recompute, breakeven = part1(levels, lossless, BANDWIDTHS)
    note = note_8b(levels)
    setup, runs, steady = part2(levels, lossless, trace, a.slo, a.chunk_tokens)
    sizes = part3(levels, lossless, trace, a.slo, CHUNK_SIZES)

    print_part1(levels, lossless, lossless_src, opts, no_loss, rows, recompute, breakeven, note)
    print_part2(setup, runs, steady, trace, a.slo, a.chunk_tokens)
    print_part3(sizes, a.slo)
    if not a.no_plot:
        for path in plot(opts, rows, runs, trace, a.slo):
            print(f"figure: {path}")

    ad = runs["adaptive"]
    write_json(a.json, {
        "best_at_gbit_per_s": {f"{r['gbps']:g}": r["best"] for r in rows},
        "fastest_at_gbit_per_s": {f"{r['gbps']:g}": r["fastest"] for r in rows},
        "ttft_s_at_gbit_per_s": {f"{r['gbps']:g}": r["ttft"] for r in rows},
        "breakeven_gbit_per_s": breakeven,
        "llama31_70b_12k_recompute_s": recompute,
        "levels_bits_per_value": {o.name: o.bits_per_token / (tm.kv_bytes_per_token(MODEL) / 2)
                                  for o in opts if not o.recompute},
        "llama31_8b_12k_recompute_s": note["recompute_s"],
        "llama31_8b_raw_breakeven_gbit_per_s": note["raw_breakeven_gbit"],
        "llama31_8b_compression_for_25gbit": note["compression_for_handout"],
        "trace_choices": ad.choices,
        "trace_ttft_s": ad.ttft_s,
        "trace_quality": ad.quality,
        "trace_rows": ad.rows,
        "policies": {name: {"choices": r.choices, "ttft_s": r.ttft_s, "quality": r.quality,
                            "text_tokens": r.text_tokens, "gpu_s": r.gpu_s} for name, r in runs.items()},
        "steady25_choices": steady.choices,
        "chunk_sizes": {str(r["chunk_tokens"]): {"ttft_s": r["adaptive"].ttft_s, "quality": r["adaptive"].quality,
                                                 "slo_met": r["adaptive"].ttft_s <= a.slo,
                                                 "choices": r["adaptive"].choices,
                                                 "oracle_ttft_s": r["oracle"].ttft_s,
                                                 "oracle_quality": r["oracle"].quality,
                                                 "all_text_ttft_s": r["text_ttft_s"],
                                                 "worst_overrun_s": r["overrun_s"]} for r in sizes},
        "setup": {"model": MODEL, "gpu": GPU, "n_gpus": N_GPUS, "context": CONTEXT, "slo_s": a.slo,
                  "chunk_tokens": a.chunk_tokens, "trace": list(zip(trace.times, trace.gbps))},
    })


if __name__ == "__main__":
    main()

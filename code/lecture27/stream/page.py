"""How 03_streaming.py shows each Part (handout §4): its tables, notes, figures and --json keys, one
show_<part>(page, result, settings) per Part, each --json key taken from the result in one place (the
Part's *_json function). The results are stream/study.py's; the handout's figures are HANDOUT below.
Part 5 (over a real socket) is shown by stream/wire_page.py, with the words and colours defined here.
"""
from __future__ import annotations

import math

from lecture27 import streaming as st
from lecture27.stream import study
from common import timemodel as tm
from common.present import (DASH, Chart, Col, Field, Handout, Page, Ref, Row, Series, Table, Val, cdf, change,
                            chart_figure, cols, handout, handout_text, plural, table_of)

K = 1024
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

SHORT = {"text": "T", "raw": "R", "level0": "L0", "level1": "L1", "level2": "L2", "level3": "L3"}
COLORS = {"level0": "#1a9850", "level1": "#91cf60", "level2": "#fee08b", "level3": "#fc8d59",
          "text": "#4575b4", "raw": "#999999"}
SUITE_STYLES = {"adaptive": ("C3", "-"), "naive adaptive": ("C3", ":"), "always level0": ("#1a9850", "-"),
                "always text": ("#4575b4", "-"), "oracle": ("k", "--")}
PARTS = [("Part 2", "policies"), ("Part 2b", "long_policies"), ("Part 2c", "real_policies")]  # Part 2d's runs


# ------------------------------------------------------------------------------------------ words
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
    rows = study.chunks(run)
    gave_up, probes = sum(1 for r in rows if r.gave_up), sum(1 for r in rows if r.probe)
    extra = [plural(gave_up, "KV transfer", "{}") + " given up"] if gave_up else []
    extra += [f"the link probed during {plural(probes, 'recompute', '{}')}"] if probes else []
    return ", ".join(parts) + (f"; {', '.join(extra)}" if extra else "")


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def quote(ref) -> list[str]:
    """The handout's statement (a Ref present.handout gave) as a note; none when the run's inputs are not its."""
    return ["handout: " + ref.figure] if ref != DASH else []


def pm(x, se, f):
    """x +- its standard error, formatted with f (nan: no noise known)."""
    return f"{x:{f}} +- {se:{f.lstrip('+')}}" if se == se else f"{x:{f}}"


# ------------------------------------------------------------------------------------------ Part 1
def part1_json(r: study.OneShot) -> dict:
    kv_options = [o for o in r.options if not o.recompute]
    return {"llama31_70b_12k_recompute_s": r.recompute_s,
            "levels_bits_per_value": {o.name: o.bits_per_value for o in kv_options},
            "breakeven_gbit_per_s": {o.name: r.breakeven[o.name] for o in kv_options},
            "ttft_s_at_gbit_per_s": {f"{b.gbps:g}": {o.name: b.ttft[o.name] for o in r.options} for b in r.rows},
            "best_at_gbit_per_s": {f"{b.gbps:g}": b.best for b in r.rows},
            "fastest_at_gbit_per_s": {f"{b.gbps:g}": b.fastest for b in r.rows},
            "vs_8bit_at_gbit_per_s": {f"{b.gbps:g}": b.vs_8bit for b in r.rows}}


def sizes_table(r: study.OneShot, s) -> Table:
    m, lv = tm.MODELS[s.model].name, r.levels
    where = ("measured by the codec on the record-world\nmodel (256 values/token)" if s.levels_file is None
             else f"read from {lv.name}")
    return table_of(
        f"Compressed sizes: each codec level's bits per value, {where}, applied to {m}'s "
        f"{tm.kv_bytes_per_token(s.model) // 2:,} values/token (kv_bytes_per_token / 2).\nText = "
        f"{st.TEXT_BYTES_PER_TOKEN} B/token of token ids, then recompute ({r.recompute_s:.2f} s for the whole "
        f"context in one batch, time model).\nLossless accuracy (raw, text) = {lv.lossless:.3f}, {lv.lossless_src}.",
        "§4.1", [Field("option", get="name"),
                 Field("bits/value", "{:.2f}", get=lambda o: None if o.recompute else o.bits_per_value),
                 Field("GB / context", "{:.3f}", get=lambda o: o.bits_per_token * s.context / 8e9),
                 Field("accuracy", "{:.3f}", get="accuracy"),
                 Field("break-even vs text", "{:.1f} Gb/s", get=lambda o: r.breakeven.get(o.name))],
        r.options, "stream.study.one_shot", json=part1_json(r))


def headline_note(r: study.OneShot, s) -> str:
    """§4.1's headline (CacheGen against 8-bit quantization) beside ours, the size ratio over the bandwidths."""
    lo, hi = (f"{f(b.vs_8bit for b in r.rows):.1f}" for f in (min, max))
    return (f"§4.1 headline: CacheGen fetches and processes a context "
            f"{handout_text(handout(HANDOUT, 'cachegen_delay', s))} faster than 8-bit quantization (LLaMA, end to "
            f"end). Ours, 8-bit KV TTFT / {r.finest.name} TTFT over {s.bandwidths[0]:g}-{s.bandwidths[-1]:g} Gb/s: "
            f"{lo}{'' if lo == hi else '-' + hi}x: with the transfer alone in the model, the size ratio of 8 bits to "
            f"{r.finest.name}'s {r.finest.bits_per_value:.2f} bits per value (a {r.levels.name} level); CacheGen's "
            "figure also pays decoding, and its levels were fitted on LLaMA.")


def show_part1(page: Page, r: study.OneShot, s) -> None:
    m = tm.MODELS[s.model].name
    page.part("Part 1", "§4.1", f"{m} on {s.n_gpus} x {s.gpu}, fetching a {s.context:,}-token context")
    page.table(sizes_table(r, s))
    best = "ours:    best " + "; ".join(f"{o} at {a:g}" + (f"-{b:g}" if b != a else "") + " Gb/s"
                                       for o, a, b in r.best_ranges)
    page.table(Table(
        title=f"\nTTFT (context on the GPU), seconds.\n'best' = fastest of {', '.join(r.no_loss)} (within "
        f"{s.no_loss_points * 100:.1f} points of lossless).", section="§4.1",
        cols=cols(("Gb/s", "{:g}"), *[(f"{o.name} s", "{:.2f}") for o in r.options], "best (no loss)", "fastest"),
        rows=[Row([b.gbps, *(b.ttft[o.name] for o in r.options), b.best, b.fastest]) for b in r.rows],
        source="stream.study.one_shot", notes=[*quote(handout(HANDOUT, "part1", s)), best, headline_note(r, s)]))
    if r.note:
        page.table(note_table(r.note, s))
    chart_figure(page, "03_ttft_vs_bandwidth.png", [Chart(
        series=[Series([b.gbps for b in r.rows], [b.ttft[o.name] for b in r.rows], f"{o.name} (acc {o.accuracy:.2f})",
                style={"marker": "o", "ms": 3, "color": COLORS.get(o.name)}) for o in r.options],
        xlabel="link bandwidth, Gb/s", ylabel="TTFT (context on GPU), s",
        title=f"{m}, {s.n_gpus} x {s.gpu}, {s.context // K}K-token context", xscale="log", yscale="log",
        grid="both")], figsize=(7, 4.2))


def note_table(n: study.Note8B, s) -> Table:
    json = {"llama31_8b_12k_recompute_s": n.recompute_s, "llama31_8b_raw_breakeven_gbit_per_s": n.raw_breakeven_gbit,
            "llama31_8b_compression_for_25gbit": n.compression}
    return Table(
        title=f"\nNote (§4.1, pitfall 1): {tm.MODELS[s.note_model].name} on one {s.note_gpu}, a {s.context:,}-token "
        "context: recompute it, or fetch its KV?", section="§4.1", cols=cols("", ("ours", "{:.1f}")), rows=[
            Row(["recompute the context, s (the time model's anchor)", Val(n.recompute_s, fmt="{:.2f}")],
                handout(HANDOUT, "8b_recompute_s", s)),
            Row([f"links that lose to recomputing, raw KV ({tm.kv_bytes_per_token(s.note_model) // K} KiB/token), "
                 "Gb/s", Val(n.raw_breakeven_gbit, fmt="below {:.1f}")], handout(HANDOUT, "8b_breakeven", s)),
            Row([f"KV compression whose break-even is {s.note_link_gbps:g} Gb/s",
                 Val(n.compression, fmt=lambda c: f"{c:.2f}x ({16 / c:.1f} bits/value)")]),
            *[Row([f"{k} KV beats recomputing above, Gb/s", v]) for k, v in n.levels_breakeven_gbit.items()]],
        source="stream.study.recompute_or_fetch", json=json)


# ------------------------------------------------------------------------------------------ Part 2
def policy_json(runs: study.Policies) -> dict:
    return {name: {"choices": r.choices, "ttft_s": r.ttft_s, "quality": r.quality, "text_tokens": r.text_tokens,
                   "gpu_s": r.gpu_s} for name, r in runs.named().items()}


def policies_table(page, s, run, title, json, fmt=compact, notes=()):
    """The four policies on the trace, with the verdicts under them."""
    runs = run.runs
    page.table(Table(title=title, section="§4.2", cols=[
        Col("policy"), Col("choices", fmt), Col("TTFT s", "{:.2f}"), Col(f"SLO {s.slo:g} s", met),
        Col("quality", "{:.3f}"), Col("recomputed tokens", "{:,}"), Col("GPU s", "{:.2f}")],
        rows=[Row([name, r.choices, r.ttft_s, runs.on_time(r), r.quality, r.text_tokens, r.gpu_s], key=name)
         for name, r in runs.named().items()], source="stream.study.policies",
        notes=[*notes, *so_notes(s, run)], json=json))


def sooner_note(name: str, r, ad, ok: bool, ok_ad: bool) -> str:
    """A policy that arrives sooner than adaptive: whether either met the SLO, and why adaptive did not."""
    both = ("both miss the SLO" if not ok else "it meets the SLO, adaptive does not" if not ok_ad
            else "both meet the SLO")
    return (f"    {name.capitalize()} arrives sooner here ({r.ttft_s:.2f} s vs {ad.ttft_s:.2f} s; {both}): adaptive "
            "chose by the rates it had measured, and the link then changed.")


def text_note(s, runs: study.Policies) -> str:
    """Always text arriving sooner than adaptive: a trade of quality for GPU time when adaptive is in time,
    else whether text met the SLO that adaptive missed."""
    ad, text = runs.adaptive, runs.text
    gpu = (f"the GPUs recompute {text.text_tokens:,} tokens ({text.gpu_s:.2f} s on {s.n_gpus} GPUs) against "
           f"adaptive's {ad.text_tokens:,} ({ad.gpu_s:.2f} s)")
    ok_ad = runs.on_time(ad)
    return f"    Always text arrives sooner ({text.ttft_s:.2f} s vs {ad.ttft_s:.2f} s) and " + (
        f"exact (quality {text.quality:.3f}), but {gpu}: adaptive trades {text.quality - ad.quality:.3f} of "
        "quality for that GPU time, which the cache exists to save." if ok_ad else
        ("meets the SLO that adaptive misses" if runs.on_time(text) else "misses the SLO too") + f"; {gpu}.")


def so_notes(s, run) -> list[str]:
    """What the adaptive policy did (counted from its choices) and its outcome, the oracle's, and what a policy
    that arrives sooner trades: a miss is said as a miss, a trade only when adaptive arrives in time."""
    runs = run.runs
    ad, orc, fin = runs.adaptive, runs.oracle, runs.finest
    ok_ad = runs.on_time(ad)
    out = [f"So: adaptive fetched {did(run.setup, ad)}: TTFT {ad.ttft_s:.2f} s (SLO {met(ok_ad)}), "
           f"quality {ad.quality:.3f}.", f"    The oracle, knowing the trace, fetched {did(run.setup, orc)}: TTFT "
           f"{orc.ttft_s:.2f} s (SLO {met(runs.on_time(orc))}), quality {orc.quality:.3f}."]
    if fin.ttft_s < ad.ttft_s:
        out.append(sooner_note(fin.policy, fin, ad, runs.on_time(fin), ok_ad))
    if runs.text.ttft_s < ad.ttft_s:
        out.append(text_note(s, runs))
    if runs.on_time(orc) and not ok_ad:
        k = run.why.worst_chunk
        row = study.chunks(ad)[k]
        out.append(f"    Adaptive misses the SLO that the oracle meets: it chose by the rates it had measured, and "
                   f"chunk {k} ({row.choice}), due at {row.predicted:.2f} s at {row.est_gbps:.2f} Gb/s, ended at "
                   f"{row.finish:.2f} s.")
    return out


def chunk_table(page, run, notes, json=None):
    """One row per chunk of an adaptive run: what it expected, chose, and got."""
    rows = [Row([i, f"{first:,}-{first + n - 1:,}", r.start, r.est_gbps, r.budget_s,
                 r.choice + (f" ({SHORT[r.gave_up]} given up)" if r.gave_up else ""), r.predicted, r.finish,
                 None if r.measured_gbps is None else f"{r.measured_gbps:.2f}" + " (probe)" * r.probe, r.gpu_start])
            for i, (r, (first, n)) in enumerate(zip(study.chunks(run.runs.adaptive), run.setup.plan))]
    page.table(Table(title="The adaptive policy, chunk by chunk:", section="§4.2", cols=cols(
        "chunk", "tokens", ("start s", "{:.3f}"), ("est Gb/s", "{:.2f}"), ("budget s", "{:.3f}"), "choice",
        ("predicted s", "{:.3f}"), ("finish s", "{:.3f}"), "measured Gb/s", ("GPU from s", "{:.3f}")), rows=rows,
        source="streaming.adaptive", notes=notes, json=json or {}))


def shape_notes(s, run, answers="answers") -> list[str]:
    """The handout's expected shape (when the run's inputs are its), and part by part what the adaptive run did,
    with what "chosen by the time left" counted."""
    w = run.why
    ours = "ours:    " + ("the trace has no drop in bandwidth, so the handout's shape cannot appear" if w.drop is None
                          else "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in w.shape.items())
                          + f" (our {w.coarsest} {answers} {w.coarsest_accuracy:.1%})")
    return quote(handout(HANDOUT, "trace", s)) + [ours] + coarser_note(run)


def coarser_note(run) -> list[str]:
    """The chunks the verdict "a coarser level after the drop, chosen by the time left" rests on, counted, with
    its definition: a coarser level predicted to fit its chunk's budget, not the fastest option when nothing fit."""
    w = run.why
    if not w.coarser_chunks:
        return []
    picked = [run.runs.adaptive.choices[k] for k in w.coarser_chunks]
    fit = len(w.by_time_left)
    return [f"         coarser after the drop: {runs_of(picked)} (chunks {spans(w.coarser_chunks)}); chosen by the "
            f"time left, i.e. predicted to fit the chunk's budget: {fit}; taken as the fastest option when no option "
            f"fit: {len(picked) - fit}"]


def spans(ks: list) -> str:
    """[15, 16, 18, 20, 21, 22] -> "15-16, 18, 20-22"."""
    out = []
    for k in ks:
        if out and out[-1][1] == k - 1:
            out[-1][1] = k
        else:
            out.append([k, k])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def why_notes(s, w, codec=False) -> list[str]:
    """Why the run looks as it does, all computed; the handout's codec (1.66x smaller than 8-bit) for scale."""
    where = "the trace never drops" if w.drop is None else (
        f"{'before' if w.complete_before_drop else 'after'} the drop at {w.drop[0]:g} s "
        f"({w.drop[1]:g} -> {w.drop[2]:g} Gb/s)")
    out = [f"Why: at {w.finest} the {w.context:,}-token context is {w.finest_gb:.3f} GB and arrives (always "
           f"{w.finest}) in {w.finest_s:.2f} s, {where}."]
    ref = handout(HANDOUT, "codec_vs_8bit", s)
    if codec and ref != DASH:
        bits = 8 / float(ref.figure)
        x = bits / w.finest_bits_per_value
        out.append(f"  The handout's codec was {ref.figure}x smaller than 8-bit quantization (about {bits:.1f} "
                   f"bits/value); ours is {w.vs_8bit:.1f}x smaller ({w.finest_bits_per_value:.2f} bits/value at "
                   f"{w.finest}): the handout's levels were about " + (f"{x:.1f}x larger." if x >= 1 else
                                                                       f"{1 / x:.1f}x smaller."))
    return out + [f"  Text (recompute chunk by chunk, {w.text_recompute_s:.2f} s of GPU) beats {w.coarsest} only "
                  f"below {w.text_breakeven_gbit:.2f} Gb/s; the trace's slowest rate is {w.slowest_gbps:g} Gb/s"
                  + (", so text never pays." if w.slowest_gbps > w.text_breakeven_gbit else ".")]


def steady_note(page, s, r) -> None:
    page.say(f"\nSteady {s.steady_gbps:g} Gb/s: {compact(r.choices)} (TTFT {r.ttft_s:.2f} s)"
             + "".join(f"; {h}" for h in quote(handout(HANDOUT, "steady", s))))


def rule_text(s) -> str:
    """§4.2's rule, and how the link and the GPU share the work in this run's model."""
    return ("Trace: " + ", ".join(f"{g:g} Gb/s from {t:g} s" for t, g in s.trace) + ".\n"
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
            "offline at every level) and text; raw FP16 KV is not streamed (CacheGen streams its levels only).")


def show_part2(page: Page, run: study.TraceRun, s) -> None:
    page.part("Part 2", "§4.2", f"adaptive streaming, chunks of {s.chunk_tokens:,} tokens, SLO {s.slo:g} s")
    page.say(rule_text(s), indent=0)
    ad = run.runs.adaptive
    chunk_table(page, run, shape_notes(s, run) + why_notes(s, run.why, codec=True), {"trace_rows": ad.rows})
    policies_table(page, s, run, "Whole context: quality = token-weighted accuracy (text chunks exact); GPU s = "
                   f"recompute time on {s.n_gpus} GPUs.\nThe oracle knows the trace: meet the SLO, then recompute "
                   "least, then lose least.", {"policies": policy_json(run.runs), "trace_choices": ad.choices,
                                               "trace_ttft_s": ad.ttft_s, "trace_quality": ad.quality})
    steady_note(page, s, run.steady)
    page.data(steady25_choices=run.steady.choices)
    figure_trace(page, "03_trace_choices.png", run, s.slo, f"Trace and each chunk's choice ({run.levels_name} levels)")


def show_part2_long(page: Page, run: study.TraceRun, s) -> None:
    page.part("Part 2b", "§4.2, Part 2's trace and SLO, a longer context; not in the handout",
              f"{run.setup.context_tokens:,} tokens")
    page.say(f"(--long-context; LLaMA-3.1 reads up to {s.max_context // K}K)")
    w, ad = run.why, run.runs.adaptive
    policies_table(page, s, run, "", {"long_policies": policy_json(run.runs), "long_trace_choices": ad.choices,
                                      "long_trace_ttft_s": ad.ttft_s}, runs_of,
                   notes=shape_notes(s, run) + why_notes(s, w))
    figure_trace(page, "03_trace_choices_long.png", run, s.slo, f"Part 2b, {w.context // K}K tokens: adaptive "
                 f"{'coarsens' if w.coarser_after_drop else 'does not coarsen'} after the drop\n(TTFT "
                 f"{ad.ttft_s:.2f} s vs always {w.finest} {w.finest_s:.2f} s; SLO {s.slo:g} s)")


def real_levels_table(run: study.TraceRun) -> Table:
    """The levels measured on SmolLM2, each with its noise, and whether their steps stand out of it."""
    lvs = study.measured(run.levels)
    return Table(
        title=f"Measured on {lvs[0].positions:,} next-token positions of evaluation prose" + (
            f" ({lvs[0].paragraphs} paragraphs; +- one standard error over paragraphs;\nstep: the paired change "
            "from the finer level, each paragraph scored at both)." if lvs[0].paragraphs else "."), section="§4.2",
        cols=cols("level", ("bits/value", "{:.2f}"), ("GB / context", "{:.3f}"), "KL from FP16", "top-1 = FP16's",
             "KL step", "top-1 step"),
        rows=[Row([o.name, o.bits_per_value, o.bits_per_token * run.setup.context_tokens / 8e9,
              pm(lv.kl, lv.kl_se, ".4f"), pm(100 * o.accuracy, 100 * lv.agree_se, ".1f") + "%",
              "" if math.isnan(lv.kl_step) else pm(lv.kl_step, lv.kl_step_se, "+.4f"),
              "" if math.isnan(lv.agree_step) else pm(100 * lv.agree_step, 100 * lv.agree_step_se, "+.1f")])
         for o, lv in zip(run.setup.options, lvs)], source="codec.smollm2.real_codec_levels",
        notes=noise_note(run.noise), json={"real_levels": run.levels})


def noise_note(noise: study.Noise | None) -> list[str]:
    """Whether KL and top-1 agreement move level by level beyond two standard errors (none: no steps measured)."""
    if noise is None:
        return []
    top1 = (f"changes within two standard errors at {', '.join(noise.unclear)}: a coarser level can score as well or "
            "better there by chance, so KL is the measure to trust." if noise.unclear else
            "falls level by level beyond two standard errors.")
    return [f"KL grows level by level {'beyond' if noise.kl_clear else 'NOT beyond'} two standard errors; top-1 "
            f"agreement {top1}"]


def show_part2_real(page: Page, run: study.TraceRun, s, max_kl: float) -> None:
    page.part("Part 2c", "§4.2 with real levels", "Part 2 again, the codec's levels measured on a real LLaMA")
    page.say(f"(SmolLM2-135M; codec/smollm2.py, the same codec with its steps searched under a KL budget of "
             f"{max_kl} nats/token on prose)")
    page.table(real_levels_table(run))
    chunk_table(page, run, shape_notes(s, run, "agrees with FP16's next token") + why_notes(s, run.why))
    ad = run.runs.adaptive
    policies_table(page, s, run, "Whole context: quality = token-weighted share of next tokens equal to FP16's "
                                 "(text chunks exact).", {"real_policies": policy_json(run.runs),
                                                          "real_trace_choices": ad.choices,
                                                          "real_trace_ttft_s": ad.ttft_s,
                                                          "real_trace_quality": ad.quality})
    steady_note(page, s, run.steady)
    page.data(real_steady25_choices=run.steady.choices)
    figure_trace(page, "03_trace_choices_smollm2_levels.png", run, s.slo,
                 "Trace and each chunk's choice, levels measured on SmolLM2")


def show_skipped(page: Page, skipped: list, part: str = "Part 2c (§4.2 with real levels)") -> None:
    for why in skipped:
        page.say(f"{part} skipped: {why}")


# ------------------------------------------------------------------------------------------ Part 2d
def model_note(name: str, run: study.TraceRun, s) -> str:
    """One run in both models: which way adaptive's TTFT moved from serial to parallel, and the SLO in each."""
    par, ser = run.in_model(True).adaptive, run.in_model(False).adaptive
    ok = [x.ttft_s <= s.slo for x in (ser, par)]
    return (f"{name}: adaptive's TTFT {change(ser.ttft_s, par.ttft_s, '{:.2f} s')} from one chunk at a time to both "
            f"at once; SLO {met(ok[0])} " + ("in both" if ok[0] == ok[1] else f"serially, {met(ok[1])} in parallel")
            + f". Parallel: {runs_of(par.choices)}; serial: {runs_of(ser.choices)}.")


def fixed_note(runs: list) -> str:
    """What the two models change for a fixed policy: nothing for a KV level, the token ids' overlap for text."""
    finest = [(r.in_model(True).finest.ttft_s, r.in_model(False).finest.ttft_s) for r in runs]
    text = max(abs(r.in_model(True).text.ttft_s - r.in_model(False).text.ttft_s) for r in runs)
    return (("A fixed KV level never uses the GPU: the same TTFT in both models. " if all(a == b for a, b in finest)
             else "A fixed KV level's TTFT differs between the models. ") + f"Always text differs by "
            f"{text * 1e3:.2f} ms at most: only the GPU works there, and the token ids of the next chunk cross "
            "during a recompute.")


def show_models(page: Page, runs: list, s) -> None:
    """Part 2d: each run of Part 2-2c (None: not run) in both models of the link and the GPU, side by side."""
    page.part("Part 2d", "§4.2", "the link and the GPU at once, or one chunk at a time")
    shown = [(name, key, run) for (name, key), run in zip(PARTS, runs) if run is not None]
    rows = [(name.removeprefix("Part "), f"{run.setup.context_tokens // K}K", p, par, run.in_model(False).named()[p])
            for name, _, run in shown for p, par in run.in_model(True).named().items()]
    json = {"by_model": {w: {key: policy_json(run.in_model(m)) for _, key, run in shown}
                         for m, w in ((True, "parallel"), (False, "serial"))}}
    page.table(table_of(
        "TTFT and recomputed tokens of each policy. parallel: the link fetches while the GPU recomputes; serial: one "
        "chunk at a time (--serial).", "§4.2",
        [Field("Part", get=0), Field("context", get=1), Field("policy", get=2),
         Field("parallel s", "{:.2f}", get=lambda x: x[3].ttft_s),
         Field("serial s", "{:.2f}", get=lambda x: x[4].ttft_s),
         Field("parallel: recomputed", "{:,}", get=lambda x: x[3].text_tokens),
         Field("serial: recomputed", "{:,}", get=lambda x: x[4].text_tokens)],
        rows, "stream.study.trace_run", [model_note(name, run, s) for name, _, run in shown]
        + [fixed_note([run for _, _, run in shown])], json))


# ------------------------------------------------------------------------------------------ Part 3
def part3_json(c: study.ChunkSizes, s) -> dict:
    return {"chunk_sizes": {str(x.chunk_tokens): {
        "all_text_ttft_s": x.text_ttft_s, "worst_overrun_s": x.overrun_s, "ttft_s": x.adaptive.ttft_s,
        "slo_met": x.adaptive.ttft_s <= s.slo, "quality": x.adaptive.quality, "oracle_ttft_s": x.oracle.ttft_s,
        "oracle_quality": x.oracle.quality, "choices": x.adaptive.choices} for x in c.rows}}


def chunk_verdict(c: study.ChunkSizes) -> str:
    """Ours against the handout's trade-off: do small batches cost, does reacting late cost (and why not)?"""
    text, late = [x.text_ttft_s for x in c.rows], c.latest
    return (f"ours:    small batches cost{'' if c.small_batches_cost else ' little here'}: all-text TTFT "
            f"{min(text):.2f}-{max(text):.2f} s across chunk sizes; " + (
                f"reacting late: worst overrun {late.overrun_s:.2f} s with {late.chunk_tokens:,}-token chunks"
                if late.overrun_s > 1e-9 else "reacting late costs nothing here: no chunk ran past its predicted "
                "finish" + " (at every size the context is in before the trace's first drop)" * c.before_drop))


def show_part3(page: Page, c: study.ChunkSizes, s) -> None:
    h = s.half_efficiency_tokens
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
            Field("slowdown", "{:.3f}", get="slowdown"), Field("all-text s", "{:.2f}", get="text_ttft_s"),
            Field("overrun s", "{:.2f}", get="overrun_s"), Field("TTFT s", "{:.2f}", get="adaptive.ttft_s"),
            Field("SLO", met, get=lambda x: x.adaptive.ttft_s <= s.slo),
            Field("quality", "{:.3f}", get="adaptive.quality"), Field("GPU s", "{:.2f}", get="adaptive.gpu_s"),
            Field("oracle s", "{:.2f}", get="oracle.ttft_s"), Field("oracle q", "{:.3f}", get="oracle.quality")],
        c.rows, "stream.study.chunk_sizes",
        [f"adaptive's choices, {x.chunk_tokens:,}-token chunks: {runs_of(x.adaptive.choices)}" for x in c.rows]
        + quote(handout(HANDOUT, "chunks", s)) + [chunk_verdict(c)], part3_json(c, s)))


# ------------------------------------------------------------------------------------------ Part 4
def suite_json(suite: study.Suite, s) -> dict:
    cells = [{"levels": c.levels, "context": c.context, "policies": c.model.policies, "best_fixed": c.best_fixed,
              "rate_ok": c.rate_ok, "quality_on_time_ok": c.quality_on_time_ok, "exceptions": c.model.exceptions,
              "other_model": c.other} for c in suite.cells]
    return {"suite": {"traces": len(suite.traces), "seed": s.suite_seed, "slo_s": s.slo,
                      "contexts": s.suite_contexts, "cells": cells}}


def promise_notes(c: study.SuiteCell, n: int, most: int) -> list[str]:
    """One level set and context: the promise checked, the broken cases with their reasons, the quality cost."""
    ad, l0, ex = c.model.adaptive, c.level0, c.model.exceptions
    out = [f"{c.levels} {c.context // K}K: broken on {len(ex)} of {n} traces; misses {ad.violation_rate:.1%} vs "
           f"{c.best_fixed}'s {c.model.policies[c.best_fixed].violation_rate:.1%}: {'yes' if c.rate_ok else 'NO'}; "
           f"on-time quality {ad.mean_quality_on_time:.4f} vs {l0.mean_quality_on_time:.4f}: "
           f"{'yes' if c.quality_on_time_ok else 'NO'}"]
    out += [f"  trace {e.trace}: {' and '.join(e.fixed_met)} met it, adaptive took {e.adaptive_ttft_s:.2f} s: chunk "
            f"{e.chunk} ({e.choice}) was due at {e.predicted_s:.2f} s at {e.est_gbps:.2f} Gb/s, ended at "
            f"{e.finish_s:.2f} s (the link fell to {e.lowest_gbps:g} Gb/s)" for e in ex[:most]]
    out += [f"  ... and {len(ex) - most} more (--json lists them all)"] * (len(ex) > most)
    out += [f"  quality of what arrived: adaptive {ad.mean_quality:.4f} < always level0's {l0.mean_quality:.4f}: the "
            "coarser levels it takes to arrive in time"] * (ad.mean_quality < l0.mean_quality)
    return out


def show_part4(page: Page, suite: study.Suite, s) -> None:
    n, (lo, hi) = len(suite.traces), s.suite_dwell_s
    page.part("Part 4", "§4.2 on many traces", f"{n} traces, seed {s.suite_seed}, as CacheGen's evaluation "
              "replays throughput traces")
    page.say(f"SLO {s.slo:g} s, chunks of {s.chunk_tokens:,} tokens. Each trace: a Markov chain over "
             f"{', '.join(f'{g:g}' for g in s.suite_gbps)} Gb/s, each rate held {lo:g}-{hi:g} s, then a neighbouring "
             f"rate (or any rate, chance {s.suite_jump:g}).")
    notes = ["The promise, per levels and context: wherever always level0 or always text meets the SLO, adaptive "
             "does; its SLO-miss rate is at most the best fixed policy's; its on-time quality at least always "
             "level0's."] + [x for c in suite.cells for x in promise_notes(c, n, s.suite_exceptions_shown)]
    page.table(Table(
        title="quality: of what arrived, late or not; on-time quality: a context past the SLO counts 0. naive "
              "adaptive: the\nsame rule keeping its last KV measurement through text and waiting for every KV chunk "
              "(no probe, no give-up).", section="§4.2",
        cols=cols("levels, context", "policy", ("SLO missed", "{:.1%}"), ("mean TTFT s", "{:.2f}"),
                                 ("p95 TTFT s", "{:.2f}"), ("quality", "{:.4f}"), ("on-time quality", "{:.4f}"),
                                 ("recomputed tokens", "{:,.0f}")),
        rows=[Row([f"{c.levels} {c.context // K}K", p, m.violation_rate, m.mean_ttft_s, m.p95_ttft_s, m.mean_quality,
              m.mean_quality_on_time, m.mean_text_tokens]) for c in suite.cells for p, m in c.model.policies.items()],
        source="stream.study.suite", notes=notes, json=suite_json(suite, s)))
    suite_models(page, suite)
    figure_suite(page, s, suite)


def suite_models(page: Page, suite: study.Suite) -> None:
    """The suite in both models of the link and the GPU, side by side: SLO misses and mean TTFT per policy."""
    rows, notes = [], []
    for c in suite.cells:
        par, ser = c.in_model(True), c.in_model(False)
        rows += [Row([f"{c.levels} {c.context // K}K", p, m.violation_rate, ser.policies[p].violation_rate,
                      m.mean_ttft_s, ser.policies[p].mean_ttft_s]) for p, m in par.policies.items()]
        notes.append(f"{c.levels} {c.context // K}K: adaptive's SLO-miss rate "
                     + change(ser.adaptive.violation_rate, par.adaptive.violation_rate, "{:.1%}")
                     + f" from serial to parallel; traces where a fixed policy meets the SLO and adaptive does not: "
                       f"{len(par.exceptions)} in parallel, {len(ser.exceptions)} serially")
    page.table(Table(title="Both models of the link and the GPU (parallel: at once; serial: one chunk at a time):",
                     section="§4.2", cols=cols("levels, context", "policy", ("parallel: missed", "{:.1%}"),
                                  ("serial: missed", "{:.1%}"), ("parallel: TTFT s", "{:.2f}"),
                                  ("serial: TTFT s", "{:.2f}")), rows=rows,
                     source="stream.study.in_model", notes=notes))


def show_setup(page: Page, s) -> None:
    page.data(setup={"model": s.model, "gpu": s.gpu, "n_gpus": s.n_gpus, "context": s.context, "slo_s": s.slo,
                     "chunk_tokens": s.chunk_tokens, "long_context": s.long_context,
                     "half_tokens": s.half_efficiency_tokens, "trace": s.trace})


# ----------------------------------------------------------------------------------------- figures
def figure_trace(page: Page, name: str, run: study.TraceRun, slo: float, title: str) -> None:
    """The trace above, each policy's chunks below (coloured by what each fetched), the SLO in red."""
    if not page.plot:
        return
    trace, runs = run.trace, run.runs.named()
    end = max(max(r.ttft_s for r in runs.values()), slo) * 1.05
    with page.figure(name, title, figsize=(8, 5), nrows=2, sharex=True,
                     gridspec_kw={"height_ratios": [1, 1.3]}) as (fig, (top, bot)):
        top.step(list(trace.times) + [end], list(trace.gbps) + [trace.gbps[-1]], where="post", color="k")
        top.set(ylabel="link, Gb/s", ylim=(0, max(trace.gbps) * 1.1))
        for i, row in ((i, row) for i, r in enumerate(runs.values()) for row in study.chunks(r)):
            text = row.gpu_start is not None
            spans = [] if text and not row.gave_up else [      # token ids alone take microseconds
                (i - 0.2, row.start, row.link_end, "#bbbbbb" if text else COLORS.get(row.choice))]
            spans += [(i + 0.2, row.gpu_start, row.finish, COLORS["text"])] if text else []
            for y, a, b, color in spans:
                bot.barh(y, b - a, left=a, height=0.4, color=color, edgecolor="k", lw=0.5)
                if b - a > 0.08:
                    bot.text((a + b) / 2, y, SHORT[row.choice] if color != "#bbbbbb" else "x", ha="center",
                             va="center", fontsize=6)
        bot.set_yticks(range(len(runs)), list(runs))
        bot.invert_yaxis()
        for a in (top, bot):
            a.axvline(slo, color="r", ls="--", lw=1)
        bot.set(xlabel="time, s (red: SLO; each policy: the link above, the GPU below; grey: a KV transfer given up)",
                xlim=(0, end))


def figure_suite(page: Page, s, suite: study.Suite) -> None:
    """CDF of TTFT over the suite, one panel per level set and context, one line per policy."""
    ctxs = list(s.suite_contexts)
    charts = [Chart(series=[Series(*cdf(r.ttft_s for r in res), p, "step",
                            {"color": SUITE_STYLES[p][0], "ls": SUITE_STYLES[p][1]}) for p, res in c.runs.items()],
                    title=f"{c.levels} levels, {c.context // K}K tokens", xscale="log", grid="both", legend=None,
                    vlines=[(s.slo, {"color": "0.5", "ls": "--", "lw": 1})], axes={"ylim": (0, 1.02)})
              for c in suite.cells]   # each level set, then each context
    for i, c in enumerate(charts):
        c.xlabel = "TTFT (context on GPU), s (grey dashes: SLO)" if i >= len(charts) - len(ctxs) else ""
        c.ylabel = "share of traces" if i % len(ctxs) == 0 else ""
    charts[0].legend = {"fontsize": 7, "loc": "lower right"}
    chart_figure(page, "03_trace_suite_ttft_cdf.png", charts, ncols=len(ctxs), sharex=True,
                 figsize=(4.2 * len(ctxs), 3.2 * (len(charts) // len(ctxs))))

"""How 03_streaming.py shows Part 5 (handout §4.2 over a real connection): SmolLM2's KV through a paced socket
beside the simulator, each level's stream layout, what the simulator was fed, the causes of the gaps, and one
trace's timeline. The results are stream/wire_study.py's; the words and colours shared with Parts 1-4 are
stream/page.py's.
"""
from __future__ import annotations

from common import timemodel as tm
from common.present import Col, Page, Row, Table, cols, pct0, pct1, plural
from lecture27 import wire
from lecture27.stream import compare, wire_study
from lecture27.stream.page import COLORS, K, SHORT, compact, met, runs_of


def gap(c) -> float:
    """Simulated TTFT against measured, as a share of the measured (positive: the simulator is slower)."""
    return c.simulated_ttft_s / c.measured_ttft_s - 1


def wire_layouts_table(r) -> Table:
    """Each level's stream layout and why: per level the chosen layout and the next best, a chunk's bytes over
    the link at the rate they were chosen at, its decode, the sum, and the rate at which the two would tie."""
    rate, n = r.layout_gbps, r.chunk_tokens
    rows = []
    for name, c in r.layouts.items():
        rows.append(Row([name] + [x for lay in (c.layout, c.runner_up) for x in (
            lay, c.bytes[lay] / K, 1e3 * c.link_s(lay), 1e3 * c.decode_s[lay], 1e3 * c.seconds(lay))]
            + [1e3 * c.breakeven_gbps(c.runner_up)]))
    at = {t: window_rate(r, t) for t in r.traces}
    other = [f"{t} {1e3 * g:.1f} Mb/s: " + (", ".join(f"{name} {c.best_at(g)}" for name, c in r.layouts.items()
                                                   if c.best_at(g) != c.layout) or "the same")
             for t, g in at.items() if t != wire_study.LAYOUT_TRACE]
    only = {c.bytes_only for c in r.layouts.values()}
    return Table(
        title=f"Each level's stream layout (kvcache.STREAM_LAYOUTS: how a group of tokens is cut into streams), "
        f"chosen for a {n}-token chunk on a link at {1e3 * rate:.2f} Mb/s (scaled): its expected bytes at that "
        "rate, then its decode on this CPU; the sum is least for the chosen layout, the next best beside it.",
        section="§4.2", cols=cols("level", Col("layout", left=True), ("KiB", "{:.1f}"), ("link ms", "{:.0f}"),
                                  ("decode ms", "{:.0f}"), ("sum ms", "{:.0f}"), Col("next best", left=True),
                                  ("KiB", "{:.1f}"),
                                  ("link ms", "{:.0f}"), ("decode ms", "{:.0f}"), ("sum ms", "{:.0f}"),
                                  ("tie at Mb/s", "{:.2f}")), rows=rows, source="stream.measure.choose_layouts",
        notes=[f"The rate: the mean of trace {wire_study.LAYOUT_TRACE!r} over the SLO window (0-{r.slo_s:g} s), the "
               f"bits the link can carry by the SLO over the SLO (wire_study.window_gbps): "
               f"{r.scale * rate:.2f} Gb/s / {r.scale:g}. A context whose transfer must fit in the SLO sees that "
               "rate on average; the rate of one moment would choose for a burst or a stall. A chunk's bytes are "
               "the codec's expectation (kvcache.context_bytes: its groups' entropy, plus each extra stream's end "
               "and length); each layout's decode of such a chunk is timed on this CPU once (best of 3, or one "
               "call of a second or more) and cached "
               "(kvstore.layout_decode_s); the least sum is kvcache.stream_plan's choice by time. More streams cost "
               "bytes and save decode time: of two layouts, the one with more bytes is the sooner above the rate "
               "where they tie, the other below it.",
               "One sender holds one set of bitstreams for every trace, so the layouts are chosen once. At the other "
               "traces' window rates: " + "; ".join(other) + f". Without a bandwidth the codec's bytes-only rule "
               f"(02's) would code a {n}-token chunk in {', '.join(sorted(only))}: the fewest bytes, few streams."])


def window_rate(r, trace: str) -> float:
    """A trace's mean rate over the SLO window, Gb/s (scaled), as the layouts' rate is taken from LAYOUT_TRACE."""
    return wire_study.window_gbps(r.traces[trace], r.slo_s)


def wire_inputs_table(r) -> Table:
    """What the simulator was fed: per option its size as coded here, its decode or recompute measured."""
    n = len(r.recompute_s)
    rows = [Row([o.name, r.layouts[o.name].layout if o.name in r.layouts else "", o.bits_per_token,
                 o.bits_per_token * r.chunk_tokens / 8 / K, None if o.recompute else 1e3 * sum(r.decode_s[o.name]) / n,
                 1e3 * sum(r.recompute_s) / n if o.recompute else None, o.accuracy]) for o in r.options]
    return Table(
        title=f"Measured on this CPU before the runs (one torch thread), {n} chunks of {r.chunk_tokens} tokens: each "
        "level's bitstream (in its layout above), its decode, and each chunk's recompute after the chunks before it; "
        "accuracy: Part 2c's agreement with FP16 (the policy's quality).", section="§4.2",
        cols=cols("option", Col("layout", left=True), ("bits/token", "{:,.0f}"), ("KiB/chunk", "{:.1f}"),
                  ("decode ms/chunk", "{:.0f}"), ("recompute ms/chunk", "{:.0f}"), ("accuracy", "{:.3f}")), rows=rows,
        source="stream.measure.prepare")


def wire_notes(r, s) -> list[str]:
    """The gaps and their causes counted, the steady trace's verdict, the pacing, the kill run, the answer."""
    runs = [(t, p, c) for t, by in r.runs.items() for p, c in by.items()]
    off = [(t, p, c) for t, p, c in runs if c.cause is not None]
    causes = {}
    for _, _, c in off:
        causes[c.cause] = causes.get(c.cause, 0) + 1
    steady = r.runs.get("steady", {})
    within = sum(abs(gap(c)) <= compare.GAP_SHARE for c in steady.values())
    late, transfer, n = r.pacing
    k, lost = r.kill, next((i for i, x in enumerate(r.kill.rows) if x.lost is not None), None)
    out = [f"gap: simulated / measured - 1. Measured and simulated differ by more than {compare.GAP_SHARE:.0%} in "
           f"{len(off)} of {len(runs)} runs; cause: the largest part of the gap measured in the run (compare.parts: "
           "decode or recompute time against the times the simulator was fed, pacing granularity, TCP, Python "
           "overhead, trace timing: a chunk asked for a little later meeting a slower stretch of the trace), or the "
           "choices when the socket's throughput led the policy elsewhere"
           + (": " + ", ".join(f"{c} x{m}" for c, m in sorted(causes.items(), key=lambda x: -x[1])) if causes else "")
           + "."]
    ad = [(t, by["adaptive"]) for t, by in r.runs.items() if "adaptive" in by]
    given = [f"{t} chunk {i} ({SHORT[g]})" for t, c in ad for i, g in enumerate(c.gave_up) if g]
    probes = plural(sum(c.probes for _, c in ad), "probe", "{}")
    out.append("Adaptive on the socket: " + (f"gave up {', '.join(given)} (cancelled, then recomputed)" if given else
                                             "gave up no KV chunk") + f"; {probes}; "
               "the margin it had learned by its last chunk (compute slowdown against the times measured alone, "
               "and the most a chunk lost besides): " + "; ".join(
                   f"{t} x{c.margin.slowdown:.2f} + {1e3 * c.margin.overhead_s:.0f} ms" for t, c in ad if c.margin)
               + ". Fixed policies meeting the SLO where adaptive missed it: " + (", ".join(
                   f"{t} ({', '.join(p for p, x in r.runs[t].items() if p != 'adaptive' and x.measured_slo_met)})"
                   for t, c in ad if not c.measured_slo_met and any(
                       x.measured_slo_met for p, x in r.runs[t].items() if p != "adaptive")) or "none") + ".")
    slow = r.slowdown
    out.append(f"    In the runs a KV chunk's decode took {slow['decode']:.2f}x, a text chunk's recompute "
               f"{slow['recompute']:.2f}x the time measured alone before them (the simulator's): the compute thread "
               "shares this CPU with the link thread, the sender process and whatever else runs.")
    if steady:
        out.append(f"Steady trace: the simulator within {compare.GAP_SHARE:.0%} of the measurement in {within} of "
                   f"{len(steady)} policies" + ("." if within == len(steady) else "; " + "; ".join(
                       f"{p} {pct0(gap(c))} ({c.cause})" for p, c in steady.items()
                       if abs(gap(c)) > compare.GAP_SHARE) + "."))
    out.append(f"Pacing (a benchmark figure, not a test): the sender's last write came {late * 1e3:.2f} ms after the "
               f"token bucket's plan on average ({n} transfers), {pct1(late / transfer)} of a KV chunk's mean transfer "
               f"({transfer * 1e3:.0f} ms, request to last byte).")
    out.append(f"Sender killed (trace {wire_study.KILL_TRACE}, adaptive) once it had sent {r.kill_after_bytes:,} "
               "bytes: "
               + (f"{k.rows[lost].lost}; chunks {lost}-{len(k.rows) - 1} recomputed from the request's text: "
                  f"{compact(k.choices)}, TTFT {k.ttft_s:.2f} s, KL {k.first_token_kl:.4f}, answer "
                  f"{'the full prefill' + chr(39) + 's' if k.same_answer else 'DIFFERENT'}: "
                  f"{'falls back and answers right' if r.kill_ok else 'FAILED'}." if lost is not None else
                  "the run never lost its sender: FAILED."))
    out.append(f"Answer: {r.question!r} -> full prefill {r.answer!r} ({r.answer_tokens} greedy tokens); "
               f"KL: the first answer token's KL(full prefill || run). Each run's answer is that of its own KV: "
               f"{r.answers_computed} distinct KVs answered, {r.answers_reused} runs' KV equal bit for bit to one of "
               f"them. Bytes received equal bytes sent in every run: {'yes' if r.bytes_equal else 'NO'}.")
    out.append(f"This Part took {r.seconds:.0f} s on this machine: {r.prepare_s:.0f} s measuring the context, "
               f"{sum(c.measured_ttft_s for by in r.runs.values() for c in by.values()) + r.kill.ttft_s:.0f} s "
               f"streaming, {r.answers_s:.0f} s answering, the rest loading the model and the "
               "codec's levels (fitted once, on a first run) and starting the senders.")
    return out


def show_wire(page: Page, r, s) -> None:
    """Part 5: the runs over the socket beside the simulator, what it was fed, the causes, the timeline."""
    page.part("Part 5", "§4.2 over a real connection", f"SmolLM2's KV through a paced socket on this machine, "
              f"{len(r.traces)} traces x {len(next(iter(r.runs.values())))} policies")
    page.say(f"SmolLM2's KV of a {r.context_tokens}-token context streams from a sender process over a localhost "
             "socket paced to each trace (a token bucket, wire.py), chunk by chunk: a KV chunk is decoded once "
             "its bytes are in, a text chunk recomputed by SmolLM2 on this CPU while the link carries the next. "
             f"Every bandwidth is divided by {r.scale:g} = {r.kv_ratio:.1f} ({tm.MODELS[wire.LECTURE_MODEL].name}'s "
             f"FP16 KV bytes per token over SmolLM2's, wire.wire_scale) x {r.scale / r.kv_ratio:.1f} (so that a chunk "
             "takes about as long on the link as this CPU takes to decode it); the traces keep their shape and times. "
             "Adaptive is the simulator's policy, the same code (streaming.run_adaptive) on the socket's clock: each "
             "chunk chosen from the throughput measured on the socket, the idle link probed while text waits for "
             "the CPU, a KV chunk not in by its give-up deadline cancelled on the socket and recomputed, and a "
             f"margin learned from this run's own compute times; SLO {r.slo_s:g} s. Beside "
             "each run, the simulator (streaming.py, the parallel model) on the same scaled trace, fed this CPU's "
             "measured times.")
    page.table(wire_layouts_table(r))
    page.table(wire_inputs_table(r))
    rows = [Row([t, p, c.measured_ttft_s, c.simulated_ttft_s, gap(c), c.measured_choices, c.simulated_choices,
                 c.measured_slo_met, c.simulated_slo_met, c.first_token_kl, c.same_answer, c.cause or ""],
                key=f"{t}/{p}") for t, by in r.runs.items() for p, c in by.items()]
    page.table(Table(
        title="Measured on the socket against simulated with this CPU's times: TTFT (context ready), choices, SLO "
        "verdicts; KL and answer: of the run's KV; cause: of a gap above 10%.", section="§4.2",
        cols=[Col("trace"), Col("policy"), Col("measured s", "{:.3f}"), Col("simulated s", "{:.3f}"),
         Col("gap", lambda x: f"{x:+.0%}"), Col("measured", runs_of, left=True), Col("simulated", runs_of, left=True),
         Col("SLO meas.", met), Col("SLO sim.", met), Col("KL", "{:.4f}"),
         Col("answer", lambda x: "same" if x else "DIFFERS"), Col("cause", left=True)], rows=rows,
        source="stream.wire_study.wire_study", notes=wire_notes(r, s), json=r.json()))
    figure_wire(page, r, "handout")


def figure_wire(page: Page, r, name: str) -> None:
    """One trace's runs, measured against simulated: the scaled trace above; per policy and chunk, its link
    span (coloured by what it fetched) above its decode or recompute span (dark), measured then simulated."""
    if not page.plot or name not in r.runs:
        return
    runs, trace = r.runs[name], r.traces[name]
    end = max(max(max(c.measured_ttft_s, c.simulated_ttft_s) for c in runs.values()), r.slo_s) * 1.05
    with page.figure("03_wire.png", f"Trace {name!r} over the socket (each policy: measured, then simulated)",
                     figsize=(8, 6), nrows=2, sharex=True, gridspec_kw={"height_ratios": [1, 2.6]}) as (_, (top, bot)):
        top.step(list(trace.times) + [end], [1e3 * g for g in trace.gbps] + [1e3 * trace.gbps[-1]], where="post",
                 color="k")
        top.set(ylabel="link, Mb/s (scaled)", ylim=(0, 1e3 * max(trace.gbps) * 1.1))
        labels = []
        for y, (p, c) in enumerate((p, c) for p, c in runs.items() for _ in (0, 1)):
            measured = y % 2 == 0
            spans, choices = (c.measured_spans, c.measured_choices) if measured else (c.simulated_spans,
                                                                                       c.simulated_choices)
            labels.append(f"{p} ({'wire' if measured else 'sim.'})")
            for (a, b, g0, g1), ch in zip(spans, choices):
                if a is not None and b - a > 0:
                    bot.barh(y - 0.2, b - a, left=a, height=0.35, color=COLORS.get(ch), edgecolor="k", lw=0.4)
                if g0 is not None:
                    bot.barh(y + 0.2, g1 - g0, left=g0, height=0.35, edgecolor="k", lw=0.4,
                             alpha=1 if measured else 0.6, color=COLORS["text"] if ch == "text" else "#444444")
        bot.set_yticks(range(len(labels)), labels, fontsize=7)
        bot.invert_yaxis()
        for a in (top, bot):
            a.axvline(r.slo_s, color="r", ls="--", lw=1)
        bot.set(xlabel="time, s (red: SLO; each row: the link above, decode (grey) or recompute (blue) below)",
                xlim=(0, end))

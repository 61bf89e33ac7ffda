"""How 02_cachegen_codec.py shows each Part of handout §3: its tables, notes and figures, and its `--json`
keys, all read from the Part's result (measures.py's dataclasses), with the handout's figures printed
beside ours. One show_<part>(page, result, settings) per Part; nothing here computes a lecture figure.
"""
from __future__ import annotations

from lecture27.codec import measures as cm
from lecture27.codec import smollm2
from lecture27.codec import study as cs
from lecture27.codec import coder_bench
from lecture27 import kvcache as kv
from common.present import (
    Chart, Field, Handout, Page, Ref, Row, Series, Table, chart_figure, cols, handout, pct1, pct2, plain, plural,
    table_of)

# The handout's figures, printed beside ours (reference only; nothing is computed from them), and the
# inputs each holds for: the record-world model's figures blank on another model, exercise 4's on
# another distribution.
RECORD = {"model": "record"}
EX4_HANDOUT = {"ex4_probs": {0: 0.70, 1: 0.12, -1: 0.12, 2: 0.03, -2: 0.03}}   # the handout's distribution
HANDOUT = Handout({
    "delta_ratio": Ref("2.4-2.9x (LLaMA)"),                       # §3.2: deltas' variance 2.4-2.9x smaller
    "sensitivity": Ref("shallow layers are the most sensitive"),  # §3.2, on LLaMA
    "entropy": Ref("up to 53% below one global table (LLaMA)"),   # §3.3
    "fp16": Ref("512 B", RECORD), "zlib": Ref("1.08x", RECORD), "6bit": Ref("no loss", RECORD),
    "recipe": Ref("worst accuracy", RECORD), "measured": Ref("no loss; 1.66x < 8-bit, 1.28x < 6-bit", RECORD),
    "vs_8bit": Ref("1.66x", RECORD), "vs_6bit": Ref("1.28x", RECORD), "level3": Ref("74%", RECORD),
    "coder": Ref("a fraction of a byte"),
    "ex4_entropy_bits": Ref("1.40", EX4_HANDOUT), "ex4_fixed_bits": Ref("3", EX4_HANDOUT),
    # §3.4: CacheGen on LLaMA, and the slides' ranges
    "cachegen_vs_8bit": Ref("3.5-4.3x (LLaMA)"), "slides_kv": Ref("3-10x smaller KV"),
    "slides_transfer": Ref("2-8x faster transfer"),
})

times2 = "{:.2f}x".format
LAYOUT_WORDS = {"group": "one stream per group", "K/V": "one stream per K/V of a group",
                "layer": "one stream per (layer, K/V) of a group",
                "channel": "one stream per (layer, K/V, channel) of a group"}


def beside(ref, text: str) -> str:
    """`text` with the handout's figure in it where `ref` (present.handout's answer) holds one, else ""."""
    return text.format(ref.figure) if isinstance(ref, Ref) else ""


def times(x: float) -> str:
    """A speed ratio: '17.0x', and below 1 with two digits ('0.03x'), where '0.0x' would say nothing."""
    return f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def keyed(prefix: str, rows: list, name: str) -> dict:
    """--json keys prefix + each row's key, the row's field `name` their value."""
    return {prefix + r.key: getattr(r, name) for r in rows}


def level_json(levels: list, *names: str) -> list:
    """The levels as --json holds them: one dict per level of the fields named."""
    return [{n: getattr(lv, n) for n in names} for lv in levels]


# ------------------------------------------------------------------------------------- Part 1
def show_observations(page: Page, r: cm.Observations, s) -> None:
    """Part 1 (§3.2) on the record-world model: locality, layer sensitivity, entropy; the locality figure."""
    page.say(f"Record-world model: {r.n_calib} calibration documents (seed {cs.CODEC_CALIB_SEED}), {r.n_eval} "
             f"evaluation documents (seed {cs.CODEC_EVAL_SEED}), {r.tokens} context tokens each, "
             f"{r.values_per_token} K/V values per token.")
    page.part("Part 1", "§3.2", "CacheGen's three observations, measured on the record-world model")
    page.table(Table(
        title="Part 1a (§3.2). Token locality: variance of raw values over variance of deltas (>1: deltas are smaller)",
        section="§3.2", cols=cols("", ("raw/delta var (anchor)", times2), ("raw/delta var (previous)", times2)),
        rows=[Row([f"layer {i} {k}", lv.ratio(k, "anchor"), lv.ratio(k, "previous")],
             handout(HANDOUT, "delta_ratio", s) if (i, k) == (0, "K") else None)
         for i, lv in enumerate(r.locality) for k in cm.KV_NAMES], source="codec.measures.delta_variance_ratios"))
    page.table(sensitivity_table(r.sensitivity, s))
    page.table(entropy_table(r.entropy, f"Part 1c (§3.2, §3.3). Entropy of the values quantized at level "
                             f"{s.entropy_level}'s steps, tables fitted on calibration contexts,\nmeasured on "
                             f"evaluation contexts." + beside(handout(HANDOUT, "entropy", s),
                                                              " CacheGen: {}; by token position hardly helps.")))
    locality_figure(page, r.locality, s)
    sens = r.sensitivity
    page.data(**plain({"delta_var_ratio": r.locality, "entropy_bits": r.entropy,
                       "layer_sensitivity_acc": [x.kv[sens.step] for x in sens.layers],
                       "layer_sensitivity_step_over_rms": sens.step,
                       "layer_sensitivity_detail": [sensitivity_detail(x, sens) for x in sens.layers],
                       "measured_steps_over_rms": sens.measured_steps}))


def sensitivity_columns(sens: cm.Sensitivity) -> list:
    """Part 1b's accuracy columns: (kind, step) for K+V at every step, then K and V alone at the single step."""
    return [(kind, x) for kind, steps in (("K+V", sens.steps), ("K", [sens.step]), ("V", [sens.step]))
            for x in steps]


def sensitivity_accuracy(layer: cm.LayerSensitivity, kind: str, step: float) -> float:
    return layer.kv[step] if kind == "K+V" else layer.k if kind == "K" else layer.v


def sensitivity_detail(layer: cm.LayerSensitivity, sens: cm.Sensitivity) -> dict:
    """One layer's Part 1b accuracies as --json holds them: "K+V@4", "K@4", ..."""
    return {f"{kind}@{x:g}": sensitivity_accuracy(layer, kind, x) for kind, x in sensitivity_columns(sens)}


def sensitivity_verdict(sens: cm.Sensitivity) -> str:
    """Which layer loses the most at the single step, and whether that is the shallowest, as on LLaMA."""
    acc = [x.kv[sens.step] for x in sens.layers]
    low = acc.index(min(acc))
    if min(acc) == max(acc):
        return f"every layer answers alike ({acc[0]:.1%})."
    return (f"layer {low} loses the most ({acc[low]:.1%} answered): "
            + ("the shallowest, as on LLaMA." if low == 0 else "not the shallowest, unlike LLaMA."))


def sensitivity_table(sens: cm.Sensitivity, s) -> Table:
    """Part 1b: each layer rounded coarsely alone, and the steps the search kept."""
    columns = sensitivity_columns(sens)
    return Table(
        title=f"Part 1b (§3.2). Layer sensitivity: one layer rounded to steps of @ x its RMS, the rest exact (FP16: "
        f"{sens.fp16_accuracy:.2%});\nlast column: the coarsest steps (x RMS) the search kept."
        + beside(handout(HANDOUT, "sensitivity", s), " CacheGen: {}."), section="§3.2",
        cols=cols("", *((f"{kind} @{x:g}", pct1) for kind, x in columns),
             ("measured steps K / V", lambda v: " / ".join(f"{x:.3g}" for x in v))),
        rows=[Row([f"layer {x.layer}", *(sensitivity_accuracy(x, kind, t) for kind, t in columns), m])
         for x, m in zip(sens.layers, sens.measured_steps)], source="codec.measures.layer_sensitivity",
        notes=[f"At steps of {sens.step:g} x RMS {sensitivity_verdict(sens)}"])


def entropy_table(entropy: dict, title: str) -> Table:
    """Part 1c: bits per value under each grouping of the tables, against one global table."""
    g0 = entropy[cm.GLOBAL]
    smaller = {g: None if g == cm.GLOBAL else 1 - b / g0 for g, b in entropy.items()}
    return table_of(title, "§3.2", [Field("tables"), Field("bits/value", "{:.3f}", get=entropy),
                                    Field("smaller than global", "{:+.1%}", get=smaller)],
                    entropy, "codec.measures.grouping_entropy")


def locality_figure(page: Page, locality: list, s) -> None:
    """Part 1a's bars, with the handout's LLaMA range as a band where it holds."""
    band = beside(handout(HANDOUT, "delta_ratio", s), "{}").split("x")[0]   # "2.4-2.9x (LLaMA)" -> "2.4-2.9"
    x = list(range(len(locality)))
    chart_figure(page, "02_delta_variance.png", [Chart(
        series=[Series(x, [lv.ratio(k, to) for lv in locality], f"{k}, delta to {to}", "bar")
         for to in ("anchor", "previous") for k in cm.KV_NAMES], ylabel="var(raw) / var(delta)",
        band=(*map(float, band.split("-")), f"CacheGen on LLaMA: {band}x") if band else None,
        hlines=[(1, {"color": "k", "lw": 0.8})], legend={"fontsize": 7},
        axes={"xticks": x, "xticklabels": [f"layer {i}" for i in x]})],
                 "Token locality on the record-world model (>1: deltas smaller)", figsize=(7, 3.6))


# ------------------------------------------------------------------------------------- Part 2
def codec_cells(c: cm.Codec, fp16: float) -> list:
    """A codec row's name, bytes/token and ratio to FP16."""
    return [c.name, c.bytes_per_token, fp16 / c.bytes_per_token]


def size_words(c: cm.Codecs, key: str, s) -> str:
    """The measured codec's size against the codec `key`: 'x smaller' or 'x larger', and the handout's ratio."""
    other = c.row(key)
    x = other.bytes_per_token / c.measured.bytes_per_token
    return ((f"{x:.2f}x smaller" if x >= 1 else f"{1 / x:.2f}x larger") + f" than {other.name}"
            + beside(handout(HANDOUT, f"vs_{key}", s), " (handout {})"))


def show_codec_table(page: Page, c: cm.Codecs, s) -> None:
    """Part 2 (§3.4) on the record-world model: the codec table, §3.4's headline, every codec in a figure."""
    page.part("Part 2", "§3.4", "The codec table")
    fp16, m = c.fp16, c.measured
    vs = [size_words(c, f"{b}bit", s) for b in s.baseline_bits]
    page.table(Table(
        title="Part 2 (§3.4). The codec table (accuracy on unseen records; the arithmetic-coded rows count\nevery byte "
        f"of the bitstream, header included, on {cs.CODEC_N_CODED} coded contexts)", section="§3.4",
        cols=cols("codec", ("bytes/token", "{:.1f}"), ("ratio to FP16", times2), ("accuracy", pct2)),
        rows=[Row([*codec_cells(x, fp16.bytes_per_token), x.quality], handout(HANDOUT, x.key or "", s))
         for x in c.codecs], source="codec.measures.record_codecs",
        notes=[f"Measured codec: {', '.join(vs)}, accuracy {100 * (m.quality - fp16.quality):+.2f} points vs FP16.",
         f"Mode chosen on calibration bits: {'anchor+delta' if c.uses_deltas else 'no deltas'} (calibration: "
         f"{c.calib_delta_bytes_per_token:.1f} vs {c.calib_raw_bytes_per_token:.1f} B/token with / without "
         f"deltas). Recipe: steps / RMS by layer {', '.join(f'{x:.3g}' for x in c.recipe_steps)}, sized to the "
         f"measured codec's bytes."]))
    page.table(headline_table(c, "record-world model", "codec.measures.record_codecs", s))
    pareto_figure(page, c)
    named = [x for x in c.codecs if x.key not in (None, "fp16", "zlib")]
    page.data(**plain({"fp16_bytes_per_token": fp16.bytes_per_token, "acc_fp16": fp16.quality,
                       "zlib_ratio": fp16.bytes_per_token / c.row("zlib").bytes_per_token,
                       "measured_uses_deltas": c.uses_deltas,
                       **keyed("bytes_", named, "bytes_per_token"), **keyed("acc_", named, "quality")}))


def headline_table(codecs: cm.Codecs, model_name: str, source: str, s) -> Table:
    """§3.4's headline: CacheGen's size against 8-bit quantization and the slides' ranges, ours beside them."""
    m = codecs.measured.bytes_per_token
    times_smaller = lambda key: next((x.bytes_per_token / m for x in codecs.codecs if x.key == key), None)  # noqa: E731
    return Table(title=f"  {model_name}: the measured codec (level 0) beside CacheGen's figures", section="§3.4",
                 cols=cols("§3.4 headline", ("ours", times2)), rows=[
                     Row(["smaller than 8-bit quantization", times_smaller("8bit")],
                         handout(HANDOUT, "cachegen_vs_8bit", s)),
                     Row(["KV smaller than FP16", times_smaller("fp16")], handout(HANDOUT, "slides_kv", s)),
                     Row(["transfer faster than FP16 KV, same link", times_smaller("fp16")],
                         handout(HANDOUT, "slides_transfer", s))],
                 source=source,
                 notes=["At a fixed bandwidth transfer time is bytes / bandwidth, so our transfer speed-up is the "
                          "size ratio; the slides' transfer range is end to end (decoding and network included)."])


def pareto_figure(page: Page, c: cm.Codecs) -> None:
    """Every codec and level by bytes/token and accuracy, with the Pareto front."""
    points = [(x.name.strip(), x.bytes_per_token, 100 * x.quality) for x in c.codecs] + [
        (f"level {lv.level}", lv.bytes_per_token, 100 * lv.accuracy) for lv in c.levels[1:]]
    ticks = [8, 16, 32, 64, 128, 256, 512]
    chart_figure(page, "02_codec_pareto.png", [Chart(
        series=[Series(b, a, f"{n}: {b:.0f} B, {a:.1f}%", "scatter", {"s": 30, "marker": mk})
         for (n, b, a), mk in zip(points, "osD^v<>pP*Xh" * 2)] + [Series(*zip(*cm.pareto_front(points)),
                                                                        "Pareto front",
                                                                        style={"color": "k", "ls": "--", "lw": 0.8})],
        xlabel="bytes / token (log)", ylabel="answer accuracy (%)", xscale="log", minor_ticks=False,
        legend={"fontsize": 7, "loc": "lower right"}, axes={"xticks": ticks, "xticklabels": ticks})],
                 "Every codec on the record-world model", figsize=(8, 5))


# ------------------------------------------------------------------------------------- Part 3
def show_coder(page: Page, r: cm.CoderCheck, s) -> None:
    """Part 3 (§3.3): the arithmetic coder against the ideal, bit-exact; then the quality levels 03 reads."""
    page.part("Part 3", "§3.3", "The arithmetic coder, and the quality levels 03 reads")
    one, many = r.one, r.many
    gap, exact = one.actual_bytes - one.ideal_bytes, one.roundtrip_exact and many.roundtrip_exact
    page.table(Table(title="Part 3 (§3.3). Arithmetic coder (level 0)", section="§3.3", cols=cols(
        "stream", ("symbols", "{:,}"), ("ideal bytes", "{:.2f}"), ("actual bytes", "{:,}"),
        ("actual - ideal", "{:+.2f}"), ("bit-exact", str)), rows=[
        Row(["one whole context, one stream", one.symbols, one.ideal_bytes, one.actual_bytes, gap,
             one.roundtrip_exact], handout(HANDOUT, "coder", s)),
        Row([f"{many.contexts} contexts, codec bitstreams", many.symbols, f"{many.ideal_bytes:.1f}", many.bytes,
             f"{many.bytes - many.ideal_bytes:+.1f}", many.roundtrip_exact])],
        source="codec.measures.coder_check", notes=[
        f"The codec's bitstreams of {many.contexts} contexts, this run ({plan_words(r.layout, many.contexts)}): "
        f"encode {many.encode_sym_per_s:,.0f} symbols/s, decode {many.decode_sym_per_s:,.0f} symbols/s. "
        + ("Lossless: the loss is only in quantization." if exact else "A round trip differs: a coder bug."),
        f"ideal = -sum log2 p under the coder's own tables; actual = the bytes written: just enough bits to name one "
        f"number inside the final interval (as wide as the message's probability), usually a bit or two over the "
        f"ideal, below it when that interval holds a short binary fraction (here {abs(gap):.2f} B "
        f"{'below' if gap < 0 else 'over'}). The codec's bitstreams add headers and "
        f"{plural(r.layout.plan.streams, 'stream')} per group."]))
    page.table(levels_table(r.codecs, s))
    page.data(**plain({"ac_ideal_bytes": one.ideal_bytes, "ac_actual_bytes": one.actual_bytes,
                       "ac_roundtrip_exact": one.roundtrip_exact,
                       "levels": level_json(r.codecs.levels, "level", "bytes_per_token", "bits_per_value",
                                            "accuracy")}))


def levels_note(c: cm.Codecs, s) -> str:
    """Whether the last level's loss is beyond the noise, and how it compares with the handout's small model."""
    se = cm.level_noise(c.levels, c.n_answers)
    top, last, ref = c.levels[0], c.levels[-1], handout(HANDOUT, f"level{c.levels[-1].level}", s)
    gap, noise = top.accuracy - last.accuracy, (se[0] ** 2 + se[-1] ** 2) ** 0.5
    note = (f"+- SE: binomial standard error over {c.n_answers:,} answers. Level {last.level} answers "
            f"{100 * abs(gap):.2f} points {'below' if gap >= 0 else 'above'} level {top.level}, ")
    if abs(gap) <= 2 * noise:
        note += f"within two standard errors ({200 * noise:.2f}): the levels' accuracies are within noise."
    else:
        note += f"{abs(gap) / noise:.0f} standard errors: a real {'loss' if gap > 0 else 'gain'}."
    if not isinstance(ref, Ref):
        return note
    note += f" The handout's small model answered {ref.figure} at level {last.level}"
    if last.accuracy > float(ref.figure[:-1]) / 100:
        return note + ("; this record-world model tolerates coarse steps where Part 1b finds it insensitive, and the "
                       "levels scale the steps the search measured on it.")
    return note + "; ours answers no more."


def level_fields(steps: str, size: str) -> list:
    """The columns every level table has: its steps (x level 0's), bytes/token, bits/value."""
    return [Field("steps", steps, get=lambda lv: kv.LEVEL_FACTOR ** lv.level),
            Field("bytes/token", size, get="bytes_per_token"), Field("bits/value", "{:.2f}", get="bits_per_value")]


def levels_table(c: cm.Codecs, s) -> Table:
    """The quality levels 03 reads, their accuracy and its noise."""
    se_of = {lv.level: e for lv, e in zip(c.levels, cm.level_noise(c.levels, c.n_answers))}
    fp16 = c.fp16.bytes_per_token
    return table_of(
        "Quality levels (§4.2) of the measured codec (codec.study.codec_levels(), read by 03_streaming.py)", "§4.2",
        [Field("level (for 03)", "level {}", get="level"), *level_fields("{:g}x", "{:.1f}"),
         Field("ratio to FP16", times2, get=lambda lv: fp16 / lv.bytes_per_token),
         Field("accuracy", pct2, get="accuracy"), Field("+- SE pts", "{:.2f}", get=lambda lv: 100 * se_of[lv.level])],
        c.levels, "codec.study.codec_study", [levels_note(c, s)],
        handout=lambda lv: handout(HANDOUT, f"level{lv.level}", s))


# ------------------------------------------------------------------------------------- exercise 3
def damage_words(e: cm.Independence) -> str:
    """What one flipped byte did: the decoder refused the stream, or these groups changed."""
    if e.rejected:
        return "makes the decoder reject the stream"
    return (f"spoils group{'s' * (len(e.spoiled_groups) != 1)} {', '.join(map(str, e.spoiled_groups)) or 'none'}"
            + " only" * (e.spoiled_groups == [e.damaged_group]))


def chain_note(e: cm.Independence) -> str:
    """Whether the previous-token chain's error grows past the anchor's along a group."""
    first, end, anchor = e.by_position[1], e.by_position[-1], [p.anchor for p in e.by_position[1:]]
    if end.chain > max(first.chain, max(anchor)):
        return (f"The chain's error grows from {first.chain:.3f} to {end.chain:.3f} steps (positions {first.position}-"
                f"{end.position}), the anchor's stays at {min(anchor):.3f}-{max(anchor):.3f}: errors add up along the "
                "chain.")
    return (f"Here the chain's error does not grow past the anchor's ({first.chain:.3f} -> {end.chain:.3f} steps; "
            f"anchor {min(anchor):.3f}-{max(anchor):.3f}).")


def show_exercise3(page: Page, r: cm.Exercise3, s) -> None:
    """Exercise 3 (§3.3): groups that decode alone, error by position; then the coders measured side by side."""
    e = r.independence
    page.exercise(3, "§3.3", "why every token of a group refers to one anchor, not to the previous token")
    page.table(table_of(
        f"The {e.groups} groups of a context decode one at a time, last first, each from its own bytes: equal to the "
        f"full decode = {e.alone_equal}. One byte flipped in group {e.damaged_group}'s payload {damage_words(e)}. A "
        "token needs only its anchor; with deltas to the previous token, position p needs all p tokens before it "
        "(serial):", "§3.3",
        [Field("position in group", get="position"), Field("|error|/step, anchor", "{:.3f}", get="anchor"),
         Field("|error|/step, previous-token chain", "{:.3f}", get="chain")], e.by_position,
        "codec.measures.independence", [chain_note(e)]))
    show_throughput(page, r.throughput, s)


def plan_words(t: cm.Layout, contexts: int = 1) -> str:
    """The codec's streams for `contexts` contexts coded together, in words."""
    n = t.streams * contexts
    return (f"{LAYOUT_WORDS[t.plan.layout]}, {plural(n, 'stream')} in {plural(contexts, 'context')} of "
            f"{t.tokens} tokens: the {kv.coder_for(n)} coder")


def plan_reason(t: cm.Layout) -> str:
    """Why the codec does not cut its groups finer: the next layout's cost, or too few streams."""
    finer = [p for p in t.plans if p.streams > t.plan.streams]
    if not finer:
        return ""
    p = finer[0]
    if p.added_share > kv.STREAM_BUDGET:
        return f"; {LAYOUT_WORDS[p.layout]} would add {p.added_share:.2%} (budget {kv.STREAM_BUDGET:.1%})"
    n = p.streams * t.streams // t.plan.streams
    return (f"; {LAYOUT_WORDS[p.layout]} would add {p.added_share:.2%} and leave {n} streams a context, too few for "
            f"the parallel coder (it pays from {kv.PARALLEL_MIN_STREAMS})")


def speed_note(t: cm.Throughput) -> str:
    """The parallel coder's speed at all streams and at the fewest, against the serial coder and constriction's."""
    c = t.coder
    i1 = c.streams.index(min(c.streams))
    x_all, x_one = c.parallel_decode[-1] / c.serial_decode, c.parallel_decode[i1] / c.serial_decode
    note = f"At all {t.rows:,} streams the parallel coder decodes {x_all:.1f}x the serial coder's symbols/s"
    if c.constriction_decode:
        note += f", constriction's compiled coder {c.constriction_decode / c.parallel_decode[-1]:.1f}x ours"
    if x_one < 1:
        note += (f"; at {plural(c.streams[i1], 'stream')} it is {1 / x_one:.0f}x slower than the serial coder: a step "
                 "costs a few dozen numpy calls however few streams share it")
    return note + (f". Each stream ends with its own flush and needs its length: {c.added_bytes[-1]:+,} bytes "
                   f"({c.added_bytes[-1] / c.one_stream_bytes:+.2%}) at {t.rows:,} streams.")


def plan_note(t: cm.Layout) -> str:
    """The codec's own streams: its layout, a group's payload, what its extra streams add, why not finer."""
    return (f"The codec's bitstreams: {plan_words(t)}; a group's payload is about {t.plan.group_bytes:,.0f} B"
            + (f", its extra streams add {t.plan.added_share:.2%} (expected)" if t.plan.streams > 1 else "")
            + plan_reason(t) + ".")


def coder_rows(t: cm.Throughput) -> list:
    """Exercise 3 measured, a row per coder: serial, parallel at each stream count, constriction's if installed."""
    c = t.coder
    rows = [Row(["serial (pure Python)", 1, c.serial_encode, c.serial_decode, 1.0, None, None])]
    for k, e, d, a in zip(c.streams, c.parallel_encode, c.parallel_decode, c.added_bytes):
        rows.append(Row([f"parallel (numpy){', all' * (k == t.rows)}", k, e, d, d / c.serial_decode, a,
                         a / c.one_stream_bytes]))
    if c.constriction_decode is not None:
        rows.append(Row(["constriction's range coder", 1, c.constriction_encode, c.constriction_decode,
                         c.constriction_decode / c.serial_decode, None, None]))
    return rows


def show_throughput(page: Page, t: cm.Throughput, s) -> None:
    """Exercise 3 measured: each coder's symbols/s on the same symbols, the parallel coder's added bytes."""
    c, mega, cap = t.coder, lambda v: f"{v / 1e6:.2f}", coder_bench.THROUGHPUT_MAX_STEPS
    notes = [f"The same {c.symbols:,} symbols (level 0, {plural(t.contexts, f'evaluation {t.unit}')}) in {t.rows:,} "
             f"rows: one per (context, layer, K/V, channel), {t.tokens} tokens each; the parallel coder takes the rows "
             f"in k runs, each run a stream. A stream of more than {cap:,} symbols is timed on its first {cap:,}.",
             speed_note(t), plan_note(t.layout),
             f"On a GPU each stream is a thread (CacheGen's coder: one per (layer, channel)): {t.rows:,} streams "
             f"of {t.tokens} symbols decode in {t.tokens} sequential steps instead of {c.symbols:,}, "
             f"{c.symbols // t.tokens:,}x fewer, where numpy here still pays a few dozen calls a step."]
    page.table(Table(title="Exercise 3 measured (§3.3): streams that decode independently, coded side by side "
                           "(symbols/s, wall clock)", section="§3.3",
                     cols=cols("coder", ("streams", "{:,}"), ("encode M sym/s", mega), ("decode M sym/s", mega),
                          ("decode vs serial", times), ("added bytes", "{:+,}"), ("added", "{:+.2%}")),
                     rows=coder_rows(t), source="codec.coder_bench.coder_throughput", notes=notes))
    every = list(c.streams).index(t.rows)     # the parallel coder at one stream per row
    encode = {"serial": c.serial_encode, "parallel": c.parallel_encode[every]}
    decode = {"serial": c.serial_decode, "parallel": c.parallel_decode[every]}
    if c.constriction_decode is not None:
        encode["constriction"], decode["constriction"] = c.constriction_encode, c.constriction_decode
    page.data(**plain({"coder_encode_sym_per_s": encode, "coder_decode_sym_per_s": decode,
                       "coder_parallel_streams": list(c.streams),
                       "coder_parallel_decode_sym_per_s": list(c.parallel_decode),
                       "coder_parallel_added_bytes": list(c.added_bytes)}))


# ------------------------------------------------------------------------------------- exercise 4
def show_exercise4(page: Page, e: cm.Exercise4, s) -> None:
    """Exercise 4 (§3.3): a distribution's entropy, the coder's bits on its samples, a fixed-length code's."""
    saving = e.fixed_bits - e.coded_bits_per_symbol
    page.exercise(4, "§3.3", "the entropy of a channel's quantized values, and a fixed-length code's bits")
    probs = ", ".join(f"{v:+d}: {p:g}" if v else f"0: {p:g}"
                      for v, p in sorted(s.ex4_probs.items(), key=lambda x: -x[1]))
    labels = {"entropy_bits": "entropy (bits/value)", "coded_bits_per_symbol": f"the coder on {s.ex4_samples:,} "
              "samples (bits/value)", "ideal_bits_per_symbol": "ideal under the coder's table (bits/value)",
              "fixed_bits": "fixed-length code (bits/value)", "roundtrip_exact": "round trip exact"}
    page.table(table_of(
        f"Entropy coding of {{{probs}}}", "§3.3", [Field("", get=0), Field("ours", lambda v: f"{v:.3f}" if
                                                   isinstance(v, float) else str(v), get=1)],
        {k: (label, getattr(e, k)) for k, label in labels.items()}, "coder.exercise4",
        [f"Arithmetic coding saves {saving:.2f} of the fixed-length code's {e.fixed_bits} bits per value ("
         f"{saving / e.fixed_bits:.0%}), within {abs(e.coded_bits_per_symbol - e.entropy_bits):.3f} bits of the "
         f"entropy." if saving > 0.005 else f"Arithmetic coding saves nothing over the fixed-length code's "
         f"{e.fixed_bits} bits per value here: the entropy is {e.entropy_bits:.3f} bits."],
        handout={k: handout(HANDOUT, f"ex4_{k}", s) for k in labels}))
    page.data(**plain({"exercise4": e}))


# ------------------------------------------------------------------------------------- a real model
def show_real_observations(page: Page, r: cm.Real, s) -> None:
    """Part 1 (§3.2) on a real LLaMA: locality by thirds of the layers, and the entropy by table grouping."""
    page.say(f"{r.name} ({r.layers} layers, {r.channels // 64} KV heads x 64): {r.n_calib} calibration and "
             f"{r.n_eval} evaluation paragraphs of the project's own prose, {r.tokens} context tokens each.")
    page.part("Part 1", "§3.2", f"CacheGen's observations on {r.name}")
    page.table(Table(
        title="Part 1a (§3.2, real model). Variance of raw values over variance of deltas, by thirds of the "
              "layers\n(>1: deltas smaller)", section="§3.2",
        cols=cols("", ("anchor: mean", times2), "range", ("previous: mean", times2), "range"),
        rows=[Row([f"layers {x.first}-{x.last} {x.kind}", *(f for m in (x.anchor, x.previous)
                                                      for f in (m[0], f"{m[1]:.2f}-{m[2]:.2f}x"))],
             handout(HANDOUT, "delta_ratio", s) if i == 0 else None) for i, x in enumerate(r.thirds)],
        source="codec.measures.delta_variance_ratios"))
    page.table(entropy_table(r.entropy, f"Part 1c (§3.2, real model). Entropy at steps of {s.real_entropy_step:g} "
                                        f"x RMS, tables fitted on calibration prose"))
    page.data(**plain({"model": r.name, "delta_var_ratio": r.locality, "entropy_bits": r.entropy}))


def show_real_codecs(page: Page, r: cm.Real, s) -> None:
    """Part 2 (§3.4) on a real LLaMA: the codec table with KL and top-1 agreement, the headline, the levels."""
    page.part("Part 2", "§3.4", f"The codec table on {r.name}, and its quality levels")
    c, fp16 = r.codecs, r.codecs.fp16.bytes_per_token
    page.table(Table(
        title=f"Part 2 (§3.4, real model). Continuations of {smollm2.REAL_CONTINUATION} tokens attending to the "
              f"decoded context KV\n(coded rows: bytes of {smollm2.REAL_CODED} contexts really coded, bit-exact "
              "round trip checked)", section="§3.4",
        cols=cols("codec", ("bytes/token", "{:,.0f}"), ("ratio to FP16", times2), ("NLL (nats/token)", "{:.4f}"),
             ("KL from FP16", "{:.4f}"), ("top-1 = FP16's", pct1)),
        rows=[Row([*codec_cells(x, fp16), x.quality.nll, x.quality.kl, x.quality.agree]) for x in c.codecs],
        source="codec.measures.measure_real",
        notes=["Measured steps / RMS (shallow, middle, deep thirds; K / V): "
               + ", ".join(f"{k:.3g} / {v:.3g}" for k, v in r.rel_steps)
               + f"; KL from FP16 kept below {smollm2.REAL_MAX_KL} nats/token on calibration prose; recipe sized to "
               "the same bytes."]))
    page.table(headline_table(c, r.name, "codec.measures.measure_real", s))
    page.table(table_of(
        "Quality levels (§4.2) of the measured codec on the real model (codec.smollm2.real_codec_levels(), read by 03)",
        "§4.2", [Field("level (03 Part 2c)", get=lambda lv: f"level {lv.level}"), *level_fields("{:.3g}x", "{:,.0f}"),
                 Field("KL from FP16", "{:.4f}", get="kl"), Field("top-1 = FP16's", pct1, get="agree")],
        c.levels, "codec.smollm2.fit"))
    page.data(**plain({"fp16_bytes_per_token": fp16, "zlib_ratio": fp16 / c.row("zlib").bytes_per_token,
                       **keyed("bytes_", c.codecs, "bytes_per_token"), **quality_json(c.codecs),
                       "levels": level_json(c.levels, "bytes_per_token", "bits_per_value", "kl", "agree")}))


def quality_json(codecs: list) -> dict:
    """A real model's rows' quality as --json holds it: nll_<row>, kl_<row>, top1_agree_<row>."""
    out = {}
    for x in codecs:
        out |= {f"nll_{x.key}": x.quality.nll, f"kl_{x.key}": x.quality.kl, f"top1_agree_{x.key}": x.quality.agree}
    return out


def show_real_exercise3(page: Page, r: cm.RealCoders, s) -> None:
    """Exercise 3 measured on a real LLaMA's KV: the coders side by side."""
    page.exercise(3, "§3.3", f"streams that decode independently, side by side: the coders on {r.model}'s KV")
    show_throughput(page, r.throughput, s)

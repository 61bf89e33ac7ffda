"""How gpu_check.py shows what it timed (gpu/measure.py): one table per Part, each row the device's median
beside the time model's figure for its GPU row and their ratio, then the H200's measurement of the same row
(common/gpu_reference.py) as a reference column, looked up through common.present.handout: it shows only
where the row is the one the H200 ran (its model, length, batch) at the same recompute ratio. The rates, the
MFU and the notes are computed from the rows; nothing here times anything."""
from __future__ import annotations

from common import gpu_reference as gr
from common import timemodel as tm
from common.present import (DASH, Chart, Col, Handout, Page, Row, Series, Table, chart_figure, handout,
                            handout_text)
from lecture27.gpu import measure as gm

# the H200's figures, each holding for the recompute ratio it ran at (this check always moves BF16 KV)
MEASURED = Handout(gr.refs(gr.H200, {"ratio": "ratio"}))


def ms(x) -> str:
    """Milliseconds as the tables write them: 1,251, 348, 25.4, 2.70, 0.867 (None: -)."""
    return DASH if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 \
        else f"{x:.3f}"


def times(x: float) -> str:
    """A ratio: 1.02x, 17.3x, 4,512x."""
    return f"{x:.2f}x" if x < 10 else f"{x:.1f}x" if x < 100 else f"{x:,.0f}x"


def span(xs, fmt: str = "{:.0%}") -> str:
    """The range of some figures as the notes write it: "32%-41%", or one figure when they print alike."""
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def milli(x):
    return None if x is None else 1e3 * x


def gbps(t: gm.Timed):
    return None if t.seconds is None or t.nbytes is None else t.nbytes / t.seconds / 1e9


def table(title: str, section: str, rows: list[gm.Timed], s, source: str, notes=(), rate: bool = False) -> Table:
    """The rows of one Part: what, measured ms, the time model's ms, measured / model (and the copy's GB/s),
    the H200's figure. Their --json keys: rows.<key>.measured_s, .timemodel_s, .measured_over_model
    (.measured_GBps)."""
    columns = [Col("what", left=True), Col("ms measured", ms, "rows.{row}.measured_s", 1e-3),
               Col(f"ms model ({s.gpu})", ms, "rows.{row}.timemodel_s", 1e-3),
               Col("measured/model", times, "rows.{row}.measured_over_model")]
    if rate:
        columns.append(Col("GB/s", "{:.1f}", "rows.{row}.measured_GBps"))
    columns.append(Col(gr.H200.label, left=True, reference=True))
    body = [Row([t.label, milli(t.seconds), milli(t.model_s), gm.share(t.seconds, t.model_s),
                 *([gbps(t)] if rate else []), handout_text(handout(MEASURED, t.key, s))], key=t.key) for t in rows]
    return Table(title=title, section=section, cols=columns, rows=body, source=source, notes=[n for n in notes if n])


def by_key(rows: list[gm.Timed]) -> dict:
    return {t.key: t for t in rows}


def mfu_of(t: gm.Timed) -> float | None:
    """The share of the datasheet's peak a measured prefill ran at: the time model's MFU scaled by model /
    measured time (the MFU that would make the model give the measurement)."""
    return None if t.seconds is None else tm.MFU * t.model_s / t.seconds


def show_prefill(page: Page, res: gm.Results, s) -> None:
    name = tm.get_model(s.prefill_model).name
    page.part("Part 1", "§1.4", f"Full prefill: what recomputing a context costs ({name})")
    mfus = [x for x in map(mfu_of, res.prefill) if x is not None]
    mm = res.matmul
    note = (f"The time model runs every prefill at MFU {tm.MFU:.3f} of the {s.gpu}'s datasheet peak "
            f"({tm.GPUS[s.gpu].bf16_flops / 1e12:,.0f} TFLOP/s BF16; fitted to the handout's LLaMA-3.1-8B, 12K "
            "tokens on one H100 = 0.36 s)" + (f"; the prefills measured here ran at {span(mfus, '{:.3f}')}"
                                              if mfus else "") + (
        f", the matmul at {2 * s.matmul ** 3 / mm.seconds / tm.GPUS[s.gpu].bf16_flops:.3f}." if mm.seconds else "."))
    page.table(table("", "§1.4", [mm] + res.prefill, s, "gpu.measure.prefill", [note]))


def show_layers(page: Page, res: gm.Results, s) -> None:
    page.part("Part 2", "§5.3", f"One layer at N tokens: full prefill against CacheBlend's {s.ratio:.0%} selective "
                                "recompute")
    rows = by_key([t for rows in res.layers.values() for t in rows])
    measured, modelled = [], []
    for model, n in [(m, n) for m in s.layer_models for n in s.layer_tokens]:
        full, rec = rows[gr.row_key("layer", model, n)], rows[gr.row_key("recompute", model, n)]
        measured.append(gm.share(rec.seconds, full.seconds))
        modelled.append(rec.model_s / full.model_s)
    got = [x for x in measured if x is not None]
    note = (f"The {s.ratio:.0%} recompute (its tokens spread at random, each attending to the keys at or before "
            f"it) took {span(got)} of the full layer's time here; the time model gives {span(modelled)}: it runs "
            "the recompute's few rows at a full prefill's efficiency." if got else "")
    page.table(table("", "§5.3", list(rows.values()), s, "gpu.measure.one_layer", [note], rate=True))


def show_kv(page: Page, res: gm.Results, s) -> None:
    m = tm.get_model(s.kv_model)
    nbytes = tm.kv_bytes_per_token(m) * s.kv_tokens
    page.part("Part 3", "§1.4, §6", f"{m.name}'s KV of {s.kv_tokens:,} tokens ({nbytes / 1e9:.2f} GB) from CPU "
                                    "memory to the device")
    rows = by_key(res.kv)
    get = lambda memory, per_layer=False: gbps(rows[gr.row_key("kv", s.kv_model, s.kv_tokens, memory=memory,  # noqa
                                                               per_layer=per_layer)])
    pinned, pageable, per_layer = get("pinned"), get("pageable"), get("pinned", True)
    note = ""
    if pinned and pageable:
        note = (f"Pinned {pinned:.1f} GB/s against the time model's {tm.GPUS[s.gpu].pcie_bw / 1e9:.0f} GB/s (the "
                f"{s.gpu}'s host link, one rate for every copy); pageable {pageable:.1f} GB/s"
                + (f", {pinned / pageable:.1f}x slower: a CPU tier that feeds the GPU keeps its KV pinned (§6)."
                   if pinned > 1.05 * pageable else ", no slower here.")
                + (f" Layer by layer, as §5.4's pipeline loads it, the pinned copy runs at {per_layer:.1f} GB/s."
                   if per_layer else ""))
    page.table(table("", "§1.4", res.kv, s, "gpu.measure.kv_copy", [note], rate=True))


def show_decode(page: Page, res: gm.Results, s) -> None:
    m = tm.get_model(s.decode_model)
    page.part("Part 4", "lecture 26", f"Decode: one step after {s.decode_context:,} tokens ({m.name}, the layers "
                                      "only)")
    outside = 2 * (m.total_params - m.linear_params)       # BF16 embeddings, LM head and norms
    note = (f"The time model's step reads every weight once ({2 * m.total_params / 1e9:.1f} GB, of which the "
            f"embeddings and LM head's {outside / 1e9:.1f} GB the step timed here leaves out) and each sequence's "
            f"KV ({tm.kv_bytes_per_token(m) * s.decode_context / 1e9:.2f} GB) at the datasheet's "
            f"{tm.GPUS[s.gpu].hbm_bw / 1e12:.1f} TB/s: a lower bound, no kernel reaches it.")
    page.table(table("", "lecture 26", res.decode, s, "gpu.measure.decode", [note]))


def show_pipeline(page: Page, res: gm.Results, s) -> None:
    m = tm.get_model(s.pipeline_model)
    page.part("Part 5", "§5.4", f"Hiding the recompute behind the loads ({m.name}, {m.n_layers} layers)")
    page.say(f"Each layer's KV copied from pinned CPU memory, then {s.ratio:.0%} of its tokens recomputed against "
             "it: one after the other on one stream, against every load enqueued on a second stream, each layer's "
             "recompute waiting for its own load only (layer l + 1 loads while layer l recomputes).")
    rows, notes = by_key(res.pipeline), []
    for n in s.pipeline_tokens:
        serial, piped = (rows[gr.row_key("pipeline", s.pipeline_model, n, schedule=x)] for x in ("serial",
                                                                                               "pipelined"))
        here = gm.share(piped.seconds, serial.seconds)
        notes.append(f"{n:,} tokens: pipelined takes " + (f"{here:.0%} of the serial time here, " if here else "")
                     + f"{piped.model_s / serial.model_s:.0%} on the time model.")
    page.table(table("", "§5.4", res.pipeline, s, "gpu.measure.pipeline", [" ".join(notes)]))


def ratio_figure(page: Page, res: gm.Results, s) -> None:
    rows = [t for t in res.all() if t.seconds is not None and t.model_s]
    if not rows:
        return
    chart_figure(page, "gpu_check.png", Chart(
        series=[Series([t.key for t in rows], [t.seconds / t.model_s for t in rows], kind="barh", fmt=" {:.2f}x",
                       style={"color": "tab:blue"})],
        xlabel=f"measured / time model ({s.gpu})", xscale="log", legend=None,
        vlines=[(1.0, {"color": "k", "lw": 1})], title=f"{res.device} against the time model"),
        figsize=(8, 1.2 + 0.28 * len(rows)))


def show(page: Page, res: gm.Results, s) -> None:
    """Every Part, the figure, and the run's --json headline figures."""
    g = tm.GPUS[s.gpu]
    page.say(f"device: {res.device}; time model: {s.gpu} ({g.name}: {g.bf16_flops / 1e12:,.0f} TFLOP/s BF16 dense, "
             f"{g.hbm_bw / 1e12:.2f} TB/s HBM, {g.pcie_bw / 1e9:.0f} GB/s host link); torch {res.torch}, "
             f"{res.dtype}, random weights of the models' shapes; each figure the median of {s.runs} runs after "
             f"{s.warmup} warm-ups, timed by {res.timer}. The last column: {gr.H200.device} on {gr.H200.date} "
             f"(common/gpu_reference.json), where the row is one it ran.")
    if s.tiny:
        page.say("--tiny: small shapes on the CPU, to test the code; the times say nothing of a GPU.")
    show_prefill(page, res, s)
    show_layers(page, res, s)
    show_kv(page, res, s)
    show_decode(page, res, s)
    show_pipeline(page, res, s)
    ratio_figure(page, res, s)
    page.data(**headline(res, s))


def headline(res: gm.Results, s) -> dict:
    """The run's setup and its headline figures for --json: the device and the time model's row, the matmul's
    TFLOP/s, the host-to-device GB/s, each recompute's share of its full layer, the KV fetch's share of
    recomputing the same tokens, each prefill's MFU."""
    rows = by_key(res.all())
    kv = lambda memory: rows[gr.row_key("kv", s.kv_model, s.kv_tokens, memory=memory)]  # noqa: E731
    prefill = rows.get(gr.row_key("prefill", s.kv_model, s.kv_tokens))
    return {"device": res.device, "gpu": s.gpu, "gpu_name": tm.GPUS[s.gpu].name, "torch": res.torch,
            "dtype": res.dtype, "timer": res.timer, "tiny": s.tiny, "runs": s.runs, "warmup": s.warmup,
            "ratio": s.ratio,
            "matmul_tflops": None if res.matmul.seconds is None else 2 * s.matmul ** 3 / res.matmul.seconds / 1e12,
            "h2d_pinned_GBps": gbps(kv("pinned")), "h2d_pageable_GBps": gbps(kv("pageable")),
            "recompute_share": {f"{model}@{n}": gm.share(rows[gr.row_key("recompute", model, n)].seconds,
                                                         rows[gr.row_key("layer", model, n)].seconds)
                                for model in s.layer_models for n in s.layer_tokens},
            "fetch_vs_prefill": gm.share(kv("pinned").seconds, prefill.seconds if prefill else None),
            "mfu_measured": {t.key.rsplit(" ", 1)[1]: mfu_of(t) for t in res.prefill}}

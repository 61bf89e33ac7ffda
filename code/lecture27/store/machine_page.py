"""How 05's Part 5 (LMCache's store on this machine, handout §1, §4, §6; exercise 9) is shown: its tables,
notes, figure and --json keys (the spec's store_* keys, StoreRun.json(), in one place). The numbers are
store/machine.py's measurement; every sentence here is chosen by them. Nothing here computes a lecture figure.
"""
from __future__ import annotations

from common.present import Col, Page, Row, Table, Val, cols, pct0, segment_bars
from lecture27.store.machine import StoreRun, beats_recompute_above_gbps

TIER_NAMES = {"ram": "RAM", "disk": "local disk", "redis": "Redis"}
FORMAT_NAMES = {"fp16": "FP16", "cachegen": "CacheGen"}
GAP_SHARE = 0.10      # the time model and the measurement "differ" above this share of the measured TTFT


def rate(gbps: float) -> str:
    """A bandwidth in GB/s as a reader compares it with a link: MB/s or GB/s, and in Mb/s or Gb/s."""
    if gbps == float("inf"):
        return "any bandwidth"
    def unit(x: float, big: str, small: str) -> str:
        return f"{x:.3g} {big}" if x >= 1 else f"{x * 1e3:.3g} {small}"
    return f"{unit(gbps, 'GB/s', 'MB/s')} ({unit(8 * gbps, 'Gb/s', 'Mb/s')})"


def link_rate(gbps: float) -> str:
    """A bandwidth in GB/s as a link's rate alone: Mb/s or Gb/s ("never" when it is infinite)."""
    if gbps == float("inf"):
        return "never"
    return f"{8 * gbps:.3g} Gb/s" if gbps >= 0.125 else f"{8e3 * gbps:.3g} Mb/s"


def token_text(token: int, ref: int) -> str:
    return f"{token} (= full prefill's)" if token == ref else f"{token} (full prefill: {ref})"


def show_store(page: Page, r: StoreRun, s) -> None:
    """Part 5, then exercise 9 for real."""
    page.part("Part 5", "§1, §4, §6", "SmolLM2's KV stored, fetched and served from each tier, timed")
    page.say(f"SmolLM2-135M's RAG context: {r.n_context:,} tokens (a {r.n_context - r.n_chunks * r.chunk_tokens}-token "
             f"chat prefix and {r.n_chunks} chunks of {r.chunk_tokens}), then a {r.n_question}-token question. Each "
             "chunk is one record, keyed by the model, its tokens and the prefix it was prefilled behind "
             f"(kvstore.ChunkKey), checksummed; FP16 holds 16 bits a value, CacheGen level {r.level} "
             f"{r.bits_per_value:.2f} bits. Serving = fetch every record, decode it, shift_kv each chunk to its place, "
             f"blend at {s.store_ratio:.0%} ({s.store_rule}), then the question; one thread of this CPU. "
             f"Redis: {r.redis_note}.")
    page.table(serving_table(r))
    page.table(layout_table(r))
    store_figure(page, r)
    show_restart(page, r)


def serving_table(r: StoreRun) -> Table:
    ref = r.tokens["full prefill"]
    rows = [Row([f"{TIER_NAMES[t]}, {FORMAT_NAMES[f]}", x.bytes, x.fetch_s * 1e3, x.decode_s, x.ttft_s,
                 x.predicted_ttft_s, token_text(r.tokens[f], ref)])
            for t, by in r.tiers.items() for f, x in by.items()]
    rows.append(Row(["full prefill, no store", "-", "-", "-", Val(r.full_prefill_s),
                     Val(r.full_prefill_s, fmt="{:.2f}*"), str(ref)]))
    return Table(title="a request served from each tier and format, against prefilling it (seconds unless marked)",
                 section="§1, §6",
                 cols=cols("served from", ("bytes", "{:,}"), ("fetch, ms", "{:.1f}"), ("decode", "{:.2f}"),
                      ("TTFT", "{:.2f}"), ("time model", "{:.2f}"), Col("first token", left=True)),
                 rows=rows, source="store.machine.measure_store", notes=serving_notes(r), json=r.json())


def serving_notes(r: StoreRun) -> list:
    fp16 = r.tiers["ram"]["fp16"]
    notes = [f"fetch: every record read back and its checksum verified; the disk's pages dropped from the page cache "
             f"first ({disk_cache_text(r)}). Measured read rates: "
             + ", ".join(f"{TIER_NAMES[t]} {rate(b / 1e9)}" for t, b in r.bandwidth.items()) + ". "
             + ("Every tier returned RAM's records byte for byte." if r.same_bytes else
                "A tier returned other bytes than RAM's: a bug, never tuning."),
             f"decode: FP16 widened to float32 in {r.tiers['ram']['fp16'].decode_s * 1e3:.0f} ms; CacheGen's "
             f"arithmetic decoding {r.tiers['ram']['cachegen'].decode_s:.2f} s ({r.decode_msym_s:.1f} M symbols/s, "
             f"every chunk's streams side by side in the {r.layout} layout), for {pct0(1 - cg_share(r))} fewer bytes. "
             f"Storing cost the engine {r.encode_s['fp16'] * 1e3:.0f} ms (FP16) and {r.encode_s['cachegen']:.2f} s "
             "(CacheGen's encoding).",
             f"From RAM in FP16 the first token comes {r.full_prefill_s / fp16.ttft_s:.1f}x sooner than by a full "
             f"prefill ({fp16.ttft_s:.2f} s against {r.full_prefill_s:.2f} s).",
             *model_notes(r), *breakeven_notes(r)]
    return notes


def cg_share(r: StoreRun) -> float:
    return r.tiers["ram"]["cachegen"].bytes / r.tiers["ram"]["fp16"].bytes


def disk_cache_text(r: StoreRun) -> str:
    share = r.tiers.get("disk", {}).get("fp16")
    share = None if share is None else share.cached_share
    if share is None:
        return "this system cannot tell how much stayed cached"
    return ("none stayed cached: the disk itself was read" if share == 0 else
            f"at most {pct0(share)} of a record stayed cached: that share came from RAM")


def model_notes(r: StoreRun) -> list:
    """The time model's column: how it is made, and why it misses where it does."""
    measured_blend = r.blend_s["fp16"]
    out = [f"time model: a CPU device calibrated by the one full prefill (*: {r.full_prefill_s:.2f} s for "
           f"{r.n_context + r.n_question:,} tokens; timemodel.cpu_device), predicting each TTFT as bytes / the tier's "
           f"read rate + the measured decode + the recompute and the question from their FLOPs "
           f"({r.predicted_blend_s:.2f} s)."]
    worst = max((x for by in r.tiers.values() for x in by.values()),
                key=lambda x: abs(x.predicted_ttft_s - x.ttft_s) / x.ttft_s)
    if abs(worst.predicted_ttft_s - worst.ttft_s) > GAP_SHARE * worst.ttft_s:
        out.append(f"It misses by up to {pct0(abs(worst.predicted_ttft_s - worst.ttft_s) / worst.ttft_s)}: the "
                   f"measured blend and question take {measured_blend:.2f} s, the FLOPs say {r.predicted_blend_s:.2f} "
                   "s. " + ("A CPU runs the few recomputed tokens' short matrix products below a long prefill's "
                            "rate, and CacheBlend's selection adds steps of its own." if measured_blend >
                            r.predicted_blend_s else "The recompute ran faster than the prefill's rate predicts."))
    else:
        out.append(f"It is within {pct0(GAP_SHARE)} of every measured TTFT.")
    return out


def versus_recompute(gbps: float, decode_s: float, recompute_s: float) -> str:
    """Where a format's fetch and decode beat recomputing: above a bandwidth, or never."""
    if gbps == float("inf"):
        return (f"never beats recomputing: its decode alone ({decode_s:.2f} s) is slower than the recompute "
                f"({recompute_s:.2f} s)")
    return f"beats recomputing over any link faster than {rate(gbps)}"


def pays_text(gbps: float) -> str:
    """Where a format beats FP16: below a bandwidth, always, or never."""
    if gbps == float("inf"):
        return "beats FP16 over any link: it is smaller and decodes as fast"
    if gbps == 0:
        return "never beats FP16: it is not smaller"
    return f"beats FP16 only below {rate(gbps)}"


def breakeven_notes(r: StoreRun) -> list:
    """01's break-even bandwidth on this CPU, and where CacheGen's smaller bitstream pays."""
    cg = r.tiers["ram"]["cachegen"]
    pays = r.cachegen_pays_below_gbps
    slowest = min(r.bandwidth.values()) / 1e9
    tail = ("." if not 0 < pays < float("inf") or slowest <= pays else
            f": every tier here reads faster (slowest {rate(slowest)}), so on this machine compression does not pay; "
            "over a slow network it does.")
    return [f"Break-even on this machine (01's formula, the recompute {r.recompute_s:.2f} s): fetching the FP16 KV "
            f"beats recomputing it over any link faster than {rate(r.breakeven_gbps)}; the bitstream, with its "
            f"{cg.decode_s:.2f} s decode, {versus_recompute(r.cachegen_breakeven_gbps, cg.decode_s, r.recompute_s)}. "
            f"It {pays_text(pays)}{tail}"]


def layout_table(r: StoreRun) -> Table:
    """The bitstream in each stream layout: bytes against decode time, and where each pays."""
    fp16 = r.tiers["ram"]["fp16"]
    blend = r.blend_s["cachegen"]
    rows = []
    for name, x in r.layouts.items():
        star, pays = "" if x.measured else "*", r.layout_pays_below_gbps(name)
        rows.append(Row([name + (" (served)" if name == r.layout else ""), x.streams, f"{x.bytes:,}{star}",
                         f"{x.decode_s:.3f}{star}", r.symbols / x.decode_s / 1e6,
                         *[x.bytes / b + x.decode_s + blend for b in r.bandwidth.values()],
                         link_rate(pays) if 0 < pays < float("inf") else pays_text(pays).split(":")[0]]))
    tiers = [f"TTFT {TIER_NAMES[t]}" for t in r.bandwidth]
    served = r.layouts[r.layout]
    notes = ["Each group of a chunk's tokens (CacheGen's anchor and its deltas) is cut into independent streams "
             "(kvcache.STREAM_LAYOUTS): one, one per K/V, per (layer, K/V), per (layer, K/V, channel). More streams "
             "cost bytes (each stream's end and its length) and let the parallel coder decode more symbols "
             "at each step. "
             f"The codec chooses by time (kvcache.stream_plan with a bandwidth): the layout whose bytes at the read "
             f"rate plus its decode take least; at the slowest tier's {rate(r.layout_gbps)} that is {r.layout}.",
             f"TTFT per tier: the records' bytes / the tier's measured read rate + the decode + the blend and question "
             f"({blend:.2f} s, measured with the served records). FP16: {fp16.bytes:,} bytes, decode "
             f"{fp16.decode_s * 1e3:.0f} ms. *: expected, not run here: the serial coder decodes those layouts "
             "(seconds a run); the codec's expected bytes and its decode timed once on this machine "
             "(kvstore.layout_decode_s, cached); the figure leaves them out.",
             f"The served layout decodes {r.symbols:,} symbols at {r.decode_msym_s:.1f} M symbols/s; the parallel "
             "coder's own rate on the longest chunk's symbols, one stream per (layer, K/V, channel) as in 02's "
             f"exercise 3, is {r.coder_msym_s:.1f} M symbols/s ({decode_share(r):.0%}). " + compiled_gap(r),
             f"Against recomputing ({r.recompute_s:.2f} s), the served layout "
             + versus_recompute(beats_recompute_above_gbps(served.bytes, served.decode_s, r.recompute_s),
                                served.decode_s, r.recompute_s) + ". The other layouts beat it over links faster than: "
             + ", ".join(f"{name} {link_rate(beats_recompute_above_gbps(x.bytes, x.decode_s, r.recompute_s))}"
                         for name, x in r.layouts.items() if name != r.layout) + "."]
    return Table(title="CacheGen's stream layouts: bytes on the link against decode time on this CPU",
                 section="§3.3, §6",
                 cols=cols(Col("layout", left=True), ("streams", "{:,}"), Col("bytes"), Col("decode, s"),
                           ("M symbols/s", "{:.1f}"), *[(t, "{:.2f}") for t in tiers],
                           Col("beats FP16 below", left=True)),
                 rows=rows, source="store.machine.measure_layouts", notes=notes)


def compiled_gap(r: StoreRun) -> str:
    """Where the rest of the way to a compiled coder goes."""
    rate = ("A compiled coder goes further" if r.constriction_msym_s is None else
            f"Constriction's compiled range coder decodes the same symbols at {r.constriction_msym_s:.1f} M symbols/s, "
            f"one stream ({r.constriction_msym_s / r.decode_msym_s:.1f}x the served decode)")
    return (f"{rate}. The gap is numpy's: each step of our coder is a few dozen array operations over every "
            "lane, each a pass through memory, and each lane's lookup lands in a table of its own (one per (layer, "
            "K/V, channel), megabytes in all) that the CPU's caches do not hold; compiled code keeps a lane's state in "
            "registers and, timed here table by table, reads one table at a time.")


def decode_share(r: StoreRun) -> float:
    """The store's decode rate over the parallel coder's own, on the same symbols."""
    return r.decode_msym_s / r.coder_msym_s if r.coder_msym_s else 0.0


def store_figure(page: Page, r: StoreRun) -> None:
    """The TTFT of each tier and format as fetch + decode + blend, beside the full prefill."""
    bars = {f"{TIER_NAMES[t]}, {FORMAT_NAMES[f]}": [(x.fetch_s, "", "fetch"), (x.decode_s, "", "decode"),
                                                    (x.ttft_s - x.fetch_s - x.decode_s, "", "blend + question")]
            for t, by in r.tiers.items() for f, x in by.items()}
    slowest = min(r.bandwidth, key=r.bandwidth.get)
    for name, x in r.layouts.items():   # each layout run here, from the slowest tier: its bytes at its read rate
        if not x.measured:
            continue
        bars[f"{name} layout, {TIER_NAMES[slowest]}"] = [
            (x.bytes / r.bandwidth[slowest], "", "fetch"), (x.decode_s, "", "decode"),
            (r.blend_s["cachegen"], "", "blend + question")]
    bars["full prefill"] = [(r.full_prefill_s, "", "prefill")]
    segment_bars(page, "05_store.png", bars, {"fetch": "tab:blue", "decode": "tab:orange",
                                              "blend + question": "tab:green", "prefill": "tab:gray"},
                 "seconds to the first token on one thread of this CPU",
                 f"SmolLM2's {r.n_context:,}-token context served from a real store", (8.5, 4.8),
                 dict(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0))


def show_restart(page: Page, r: StoreRun) -> None:
    """Exercise 9 with two processes: the engine restarts, the KV service keeps the chunks."""
    page.exercise(9, "§6.1", "a separate KV service process, for real: an engine restarts, the KV stays")
    d = r.restart
    if d is None:
        page.say(f"Not run: no Redis server here ({r.redis_note}).")
        return
    first = r.tiers["redis"]["fp16"]
    rows = [Row(["engine 1 (this process)", "prefilled the chunks, stored them in Redis, answered from Redis",
                 first.ttft_s, token_text(r.tokens["fp16"], r.tokens["full prefill"])]),
            Row([f"engine 2 (a new process, model loaded in {d.load_s:.1f} s)",
                 f"found {d.hits} of {d.chunks} records in Redis by their tokens, prefilled none of them", d.ttft_s,
                 token_text(d.token, r.tokens["full prefill"])])]
    same = r.restart_same_token
    page.table(Table(title="the Redis server is a process of its own: it outlives the engine", section="§6.1",
                     cols=cols("engine", Col("what it did", left=True), ("TTFT, s", "{:.2f}"),
                          Col("first token", left=True)), rows=rows,
                     source="store.machine.restart_engine",
                     notes=[("The restart kept the KV: " if d.hits == d.chunks else "The restart lost some of the KV: ")
                      + f"the second engine skipped the prefill of {d.hits} of {d.chunks} records and answered in "
                      f"{d.ttft_s:.2f} s, against {r.full_prefill_s:.2f} s for a full prefill, with "
                      + ("the first engine's first token." if same else "another first token than the first engine's.")
                      + " A KV library inside the engine would have lost its cache with the process."]))

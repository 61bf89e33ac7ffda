"""CacheGen's KV codec (handout §3.3, CacheGen §5.2), with its quality levels for streaming (§4):
change-based coding (anchor + delta in groups of tokens), per-layer quantization, and arithmetic
coding with one table per (layer, K/V, channel); its bitstream of independent groups, each cut into the
streams a GPU would code side by side (the stream plan); the levels at coarser steps and CacheGen's
published recipe. numpy only: pure functions on arrays that return data. The arithmetic coder is
coder.py's (one stream) and coder_parallel.py's (many at once); measuring a codec on a model (the step
search, the answers read from decoded KV) is codec/study.py's (codec/smollm2.py's on a real LLaMA); the scripts
print and plot.

Sections of this file:
  1. CacheGen-style codec    -- anchor + delta, per-layer quantization, per-(channel, layer) tables (§3.3)
  2. Levels and the recipe   -- a codec at coarser steps for streaming (§4), CacheGen's published recipe
"""
from __future__ import annotations

import functools
import math
import struct
import zlib
from dataclasses import dataclass, replace

import numpy as np

from common.clock import fastest
from lecture27.coder import (AC_PRECISION, AC_TOTAL, CorruptStream, FreqTable, cdfs_by_size, decode, encode, ideal_bits,
                             make_tables, unseen_uniform)
from lecture27.coder_parallel import (TableStack, decode_lanes, decode_streams, encode_streams, read_varint_runs,
                                      read_varints, stack_tables, varint)

# ========================================================================= 1. CacheGen-style codec
# A context's KV seen as one array X of shape (T, L, 2, C): token x layer x {K, V} x channel, where
# C = n_kv_heads * head_dim (channel c = head * head_dim + dim). The codec follows CacheGen §5.2:
#   1. change-based coding: tokens in groups of CODEC_GROUP. The first token of a group, the anchor, is
#      quantized alone to 8 bits (a step per channel); the others code only their delta to the
#      *decoded* anchor. Every token refers to the same anchor, so a group decodes alone, and each of
#      its tokens needs only the anchor (exercise 3). delta=False is the variant without deltas.
#   2. per-layer quantization: a delta (or a raw value) is rounded to a multiple of steps[layer, K/V].
#   3. arithmetic coding with one table per (layer, K/V, channel) -- and one more per channel for the
#      anchors -- fitted once per model on calibration contexts; encoder and decoder share them.
# Everything an encoder and a decoder must agree on is a CodecSpec. The loss is in `quantize` alone:
# decode(encode(X)) == quantize(X) bit for bit, and dequantize() turns the integers back into KV.
# Bitstream: header (magic, version, level, flags, group, tokens, spec fingerprint), each group's
# byte length (varint), then one payload per group. A payload is the group's independent streams (what
# one holds: STREAM_LAYOUTS, chosen by stream_plan, named in the flags): the byte length of each but the
# last (varint), then their arithmetic-coded bytes. A group of one stream is coded in token order.
CODEC_VERSION = 1
CODEC_GROUP = 10           # tokens per group; the first is the anchor (CacheGen §5.2)
ANCHOR_BITS = 8            # the anchor is quantized alone to 8 bits (CacheGen §5.2)
ANCHOR_MAX = (1 << (ANCHOR_BITS - 1)) - 1      # symmetric: -127..127
CODEC_MAX_RADIUS = 2047    # delta / raw symbols are clipped to [-R, R], R fitted, at most this
CODEC_MAGIC = b"KV"
_CODEC_HEADER = struct.Struct("<2sBBBBHI")     # magic, version, level, flags, group, tokens, fingerprint
CODEC_HEADER_BYTES = _CODEC_HEADER.size
STREAM_LAYOUTS = ("group", "K/V", "layer", "channel")   # one stream per group, per K/V of a group, per
                                                        # (layer, K/V) or per (layer, K/V, channel) of a group
STREAM_BUDGET = 0.005      # a group is cut into more streams only while they add at most 0.5% to its bytes
STREAM_END_BYTES = 1 / 3   # a stream's end costs about a third of a byte over its ideal length (test_coder)
PARALLEL_MIN_STREAMS = 256  # fewer streams side by side: the serial coder is faster (it makes the same bytes)
LAYOUT_TIMING_S = 1.0      # a layout's decode this long is timed once (layout_decode_seconds), not best of 3


@dataclass(frozen=True, eq=False, kw_only=True)
class CodecSpec:
    """What the encoder and the decoder share: fitted once per model (and level) by `fit_codec`."""
    steps: np.ndarray          # (L, 2) float32: quantization step of deltas (or raw values), per layer and K/V
    delta: bool                # anchor + delta (True), or every token quantized alone (False)
    anchor_scale: np.ndarray   # (L, 2, C) float32: the anchors' 8-bit step, per channel
    radius: np.ndarray         # (L, 2) int: delta / raw symbols lie in [-R, R]
    tables: tuple = ()         # FreqTables: per (layer, K/V, channel), then the anchors' (if delta)
    level: int = 0
    group: int = CODEC_GROUP

    @functools.cached_property
    def fingerprint(self) -> int:
        """CRC-32 of everything above: the bitstream names the spec it was coded with."""
        h = zlib.crc32(np.asarray(self.steps, np.float32).tobytes())
        for part in (np.asarray(self.anchor_scale, np.float32), np.asarray(self.radius, np.int64),
                     np.array([self.delta, self.level, self.group], np.int64)):
            h = zlib.crc32(part.tobytes(), h)
        for t in self.tables:
            h = zlib.crc32(np.asarray(t.cdf, np.int64).tobytes(), h)
        return h

    @property
    def shape(self):
        return self.anchor_scale.shape    # (L, 2, C)

    @functools.cached_property
    def stack(self) -> TableStack:
        return stack_tables(self.tables)


def _anchor_mask(T: int, group: int) -> np.ndarray:
    return np.arange(T) % group == 0


def _anchor_values(a: np.ndarray, spec: CodecSpec) -> np.ndarray:
    return a.astype(np.float32) * spec.anchor_scale   # the decoded anchors; the encoder uses the same


def quantize(X, spec: CodecSpec) -> np.ndarray:
    """KV (..., T, L, 2, C) -> integers of the same shape: the codec's only lossy step.
    With deltas, anchor rows hold the anchor's 8-bit value and the other rows their delta to the
    decoded anchor, in steps of steps[layer, K/V]; without deltas every row is a raw value in steps."""
    X = np.asarray(X, np.float32)
    step, R = spec.steps[:, :, None].astype(np.float32), spec.radius[:, :, None]
    if not spec.delta:
        return np.clip(np.rint(X / step), -R, R).astype(np.int32)
    T = X.shape[-4]
    anchors = _anchor_mask(T, spec.group)
    a = np.clip(np.rint(X[..., anchors, :, :, :] / spec.anchor_scale), -ANCHOR_MAX, ANCHOR_MAX)
    owner = np.arange(T) // spec.group                  # the group (and so the anchor) of each token
    d = _anchor_values(a, spec)[..., owner, :, :, :]     # each token's decoded anchor; then in place:
    np.subtract(X, d, out=d)                            # its delta, in steps, rounded and clipped
    np.divide(d, step, out=d)
    np.clip(np.rint(d, out=d), -R, R, out=d)
    q = d.astype(np.int32)
    q[..., anchors, :, :, :] = a
    return q


def dequantize(q, spec: CodecSpec) -> np.ndarray:
    """Integers from `quantize` (or the decoder) -> float32 KV of the same shape."""
    q = np.asarray(q)
    x = q.astype(np.float32) * spec.steps[:, :, None].astype(np.float32)
    if spec.delta:
        T = q.shape[-4]
        anchors = _anchor_mask(T, spec.group)
        anchor = _anchor_values(q[..., anchors, :, :, :], spec)
        x += anchor[..., np.arange(T) // spec.group, :, :, :]
        x[..., anchors, :, :, :] = anchor
    return x


def symbols(q: np.ndarray, spec: CodecSpec):
    """Integers (..., T, L, 2, C) -> (symbols, table ids), same shape: value tables are numbered
    (layer, K/V, channel); anchor tables follow them."""
    L, _, C = spec.shape
    n = L * 2 * C
    ids = np.broadcast_to(np.arange(n).reshape(L, 2, C), q.shape).copy()
    syms = q + spec.radius[:, :, None]
    if spec.delta:
        anchors = _anchor_mask(q.shape[-4], spec.group)
        ids[..., anchors, :, :, :] += n
        syms[..., anchors, :, :, :] = q[..., anchors, :, :, :] + ANCHOR_MAX
    return syms, ids


def _table_sizes(spec: CodecSpec) -> np.ndarray:
    L, _, C = spec.shape
    sizes = np.repeat(2 * np.asarray(spec.radius).ravel() + 1, C)
    return np.concatenate([sizes, np.full(L * 2 * C, 2 * ANCHOR_MAX + 1)]) if spec.delta else sizes


def _fit_counts(calib, steps, delta: bool, level: int, group: int | None):
    """fit_codec's work before the tables: (its spec without tables, counts (tables, largest size) of each
    symbol of calib, each table's size)."""
    group = CODEC_GROUP if group is None else group
    calib = np.asarray(calib, np.float32)
    L = calib.shape[-3]
    steps = np.broadcast_to(np.asarray(steps, np.float32), (L, 2)).copy()
    if not np.all(steps > 0):
        raise ValueError("quantization steps must be positive")
    anchor_scale = np.maximum(np.abs(calib).max(axis=tuple(range(calib.ndim - 3))), 1e-8) / ANCHOR_MAX
    spec = CodecSpec(steps=steps, delta=bool(delta), anchor_scale=anchor_scale.astype(np.float32),
                     radius=np.full((L, 2), CODEC_MAX_RADIUS), level=int(level), group=int(group))
    q = quantize(calib, spec)
    free = q if not delta else q[..., ~_anchor_mask(q.shape[-4], group), :, :, :]
    seen = np.abs(free).max(axis=tuple(range(free.ndim - 3)) + (free.ndim - 1,)) if free.size else np.zeros((L, 2))
    spec = replace(spec, radius=np.minimum(CODEC_MAX_RADIUS, np.ceil(seen * 1.25) + 2).astype(np.int64))
    syms, ids = symbols(q, spec)  # the radius covers every value seen, so q is unchanged by it
    sizes = _table_sizes(spec)
    # counted with each table's symbols end to end (table j's from first[j]): fewer bins than tables x the
    # largest size, so the count stays in the CPU cache; then laid out as (tables, largest size)
    first = np.cumsum(sizes) - sizes
    flat = np.bincount((first[ids] + syms).ravel(), minlength=int(sizes.sum()))
    counts = np.zeros((len(sizes), int(sizes.max())), np.int64)
    counts[np.repeat(np.arange(len(sizes)), sizes), np.arange(flat.size) - np.repeat(first, sizes)] = flat
    return spec, counts, sizes


def fit_codec(calib, steps, delta: bool, level: int = 0, group: int | None = None) -> CodecSpec:
    """Fit a codec on calibration KV (N, T, L, 2, C): the anchors' per-channel 8-bit step (largest
    |value| / 127), the symbol radius (largest |symbol| seen, plus a margin, then clipped), and one
    table per (layer, K/V, channel) from the counts of each symbol. group: tokens per anchor group
    (CODEC_GROUP unless given)."""
    spec, counts, sizes = _fit_counts(calib, steps, delta, level, group)
    return replace(spec, tables=make_tables(unseen_uniform(counts), sizes))


def fitted_bits(calib, steps, delta: bool) -> float:
    """codec_bits(fit_codec(calib, steps, delta), calib), from the counts the fit makes: each (table,
    symbol) count times -log2 of its quantized frequency, without building the tables (match_bytes
    asks a dozen times, and SmolLM2's codec has 11,520 of them)."""
    _, counts, sizes = _fit_counts(calib, steps, delta, 0, None)
    bits = 0.0
    for rows, n, cdfs in cdfs_by_size(unseen_uniform(counts), sizes):
        bits -= float((counts[rows, :n] * np.log2(np.diff(cdfs, axis=1) / AC_TOTAL)).sum())
    return bits



@dataclass(frozen=True)
class StreamPlan:
    """How a codec cuts each group into independent streams (exercise 3), and what the cut costs."""
    layout: str            # what one stream holds: one of STREAM_LAYOUTS
    streams: int           # streams per group
    group_bytes: float     # a full group's expected payload: its symbols' entropy under the tables
    added_bytes: float     # expected bytes the extra streams add to it: their ends and their lengths

    @property
    def added_share(self) -> float:
        return self.added_bytes / self.group_bytes if self.group_bytes else 0.0


def _layout_streams(spec: CodecSpec) -> dict:
    L, _, C = spec.shape
    return {"group": 1, "K/V": 2, "layer": 2 * L, "channel": 2 * L * C}


def stream_plans(spec: CodecSpec) -> list:
    """Every layout's StreamPlan: a full group's expected bytes (the entropy of each table times the
    symbols it codes in a group) and, for S streams, (S - 1) x (STREAM_END_BYTES + the bytes of a
    stream's length)."""
    stack = spec.stack
    inner = np.ones(stack.cdf.size - 1, bool)
    inner[(stack.start + stack.size)[:-1]] = False              # entries that cross into the next table
    p = np.diff(stack.cdf) / AC_TOTAL
    h = np.where(inner & (p > 0), -p * np.log2(np.where(p > 0, p, 1)), 0)
    table_bits = np.bincount(np.repeat(np.arange(len(stack.size)), stack.size + 1)[:-1], h, len(stack.size))
    n_value = table_bits.size // 2 if spec.delta else table_bits.size
    group_bits = table_bits[:n_value].sum() * (spec.group - spec.delta) + table_bits[n_value:].sum()
    out = []
    for layout, S in _layout_streams(spec).items():
        length_bytes = len(varint(int(group_bits / 8 / S)))
        out.append(StreamPlan(layout, S, group_bits / 8, (S - 1) * (STREAM_END_BYTES + length_bytes)))
    return out


def stream_plan(spec: CodecSpec, tokens: int, gbps: float | None = None, decode_s: dict | None = None) -> StreamPlan:
    """The layout the codec uses for a context of `tokens` tokens. Without a bandwidth: the one with the
    most streams whose expected added bytes stay within STREAM_BUDGET of a group's payload; but one stream
    per group when even those would leave the context fewer than PARALLEL_MIN_STREAMS streams (the serial
    coder codes it then, and more streams would only add bytes). With the bandwidth of the link or tier the
    bitstream is read over (gbps, 1e9 bytes/s) and each layout's decode seconds for such a context on this
    machine (decode_s, layout_decode_seconds): the layout whose expected bytes over that bandwidth plus its
    decode take the least time. More streams cost bytes and save decode time; the bandwidth sets the price."""
    plans = stream_plans(spec)
    if gbps is None:
        best = [p for p in plans if p.streams == 1 or p.added_share <= STREAM_BUDGET][-1]
        return best if coder_for(best.streams * -(-tokens // spec.group)) == "parallel" else plans[0]
    if gbps <= 0 or not decode_s or set(decode_s) != {p.layout for p in plans}:
        raise ValueError("choosing a layout by time needs a positive bandwidth and every layout's decode seconds")
    return min(plans, key=lambda p: context_bytes(spec, tokens, p) / (gbps * 1e9) + decode_s[p.layout])


def context_bytes(spec: CodecSpec, tokens: int, plan: StreamPlan) -> float:
    """A context's expected bitstream bytes in the plan's layout: the header, each group's length, and its
    payload (a group's entropy, in proportion to its tokens, plus the bytes its extra streams add)."""
    n_groups = -(-tokens // spec.group)
    per_group = plan.group_bytes + plan.added_bytes
    return (CODEC_HEADER_BYTES + n_groups * len(varint(int(per_group))) + plan.group_bytes * tokens / spec.group
            + plan.added_bytes * n_groups)


def sample_context(spec: CodecSpec, tokens: int, seed: int = 0) -> np.ndarray:
    """A context's integers (tokens, L, 2, C) drawn from the codec's own tables: what its bitstream would
    hold, for timing the decoder without a model."""
    stack, ids = spec.stack, _table_ids(tokens, spec)
    u = np.random.default_rng(seed).integers(0, AC_TOTAL, ids.shape)
    # searched a value at a time down each column, whose values share a table: each search then walks a path the
    # one before it walked (the stack's keys, cached), 3-4x faster than across a token's values, one per table
    at = np.searchsorted(stack.keys, np.ascontiguousarray((ids << (AC_PRECISION + 1) | u).T), "right").T - 1
    L, _, C = spec.shape
    offset = np.concatenate([np.repeat(np.asarray(spec.radius).ravel(), C), np.full(L * 2 * C, ANCHOR_MAX)])
    return (at - stack.start[ids] - offset[ids]).astype(np.int32).reshape(tokens, *spec.shape)


def layout_decode_seconds(spec: CodecSpec, tokens: int, repeats: int = 3) -> dict:
    """{layout: seconds to decode a context of `tokens` tokens in it}, timed on this machine (best of
    `repeats`, or one call when it takes LAYOUT_TIMING_S or more: clock.fastest) on a context drawn from the
    codec's tables (sample_context). A layout the serial coder
    decodes is timed on one group and scaled by the context's groups: that coder's time grows with its
    symbols, and a whole context would take it seconds."""
    X = dequantize(sample_context(spec, tokens), spec)
    out = {}
    for p in stream_plans(spec):
        serial = coder_for(p.streams * -(-tokens // spec.group)) == "serial"
        part = X[:min(tokens, spec.group)] if serial else X
        data = codec_encode(part, spec, p.layout)
        _, best = fastest(functools.partial(codec_decode, data, spec), repeats, enough_s=LAYOUT_TIMING_S)
        out[p.layout] = best * tokens / len(part)
    return out


def coder_for(n_streams: int) -> str:
    """The coder that codes n_streams side by side fastest: "parallel" or "serial" (equal bytes)."""
    return "parallel" if n_streams >= PARALLEL_MIN_STREAMS else "serial"


def _stream_order(T: int, spec: CodecSpec, layout: str):
    """A context's symbols in stream order, group by group: -> (the flat (T, L, 2, C) index of each,
    each stream's length, streams per group)."""
    L, _, C = spec.shape
    S = _layout_streams(spec)[layout]
    axes = {"group": (0, 1, 2, 3), "K/V": (2, 0, 1, 3), "layer": (1, 2, 0, 3), "channel": (1, 2, 3, 0)}[layout]
    idx = np.arange(T * L * 2 * C).reshape(T, L, 2, C)
    blocks = [idx[g:g + spec.group] for g in range(0, T, spec.group)]
    return (np.concatenate([b.transpose(axes).ravel() for b in blocks]),
            np.concatenate([np.full(S, b.size // S) for b in blocks]), S)


def _encode_any(syms, lengths, spec: CodecSpec, ids):
    """encode_streams, or the serial coder stream by stream where that is faster (the same bytes)."""
    if coder_for(len(lengths)) == "parallel":
        return encode_streams(syms, lengths, spec.stack, ids)
    ends = np.cumsum(lengths)
    parts = [encode(syms[e - n:e], spec.tables, ids[e - n:e]) for e, n in zip(ends, lengths)]
    return b"".join(parts), np.array([len(p) for p in parts], np.int64)


def _decode_any(data, nbytes, lengths, spec: CodecSpec, ids):
    if coder_for(len(lengths)) == "parallel":
        return decode_streams(data, nbytes, lengths, spec.stack, ids)
    ends, bends = np.cumsum(lengths), np.cumsum(nbytes)
    return np.concatenate([np.zeros(0, np.int64)] + [
        decode(data[be - nb:be], spec.tables, int(n), ids[e - n:e])
        for e, n, be, nb in zip(ends, lengths, bends, nbytes)])


def codec_encode_many(X, spec: CodecSpec, layout: str | None = None) -> list:
    """Contexts' KV (N, T, L, 2, C) -> one bitstream per context: header, group lengths, one payload
    per group; a payload is its streams (stream_plan's layout unless `layout` names another): the byte
    length of each but the last, then their bytes. Every stream of every context is coded side by side."""
    X = np.asarray(X, np.float32)
    if X.ndim != 5 or X.shape[2:] != spec.shape or not 0 < X.shape[1] < 1 << 16:
        raise ValueError(f"need KV of shape (N, T, {', '.join(map(str, spec.shape))}) with 0 < T < 65536")
    N, T = X.shape[:2]
    layout = stream_plan(spec, T).layout if layout is None else layout
    syms, ids = symbols(quantize(X, spec), spec)
    order, lengths, S = _stream_order(T, spec, layout)
    at = (np.arange(N)[:, None] * order.size + order).ravel()
    data, nbytes = _encode_any(syms.ravel()[at], np.tile(lengths, N), spec, ids.ravel()[at])
    ends = np.cumsum(nbytes)
    header = _CODEC_HEADER.pack(CODEC_MAGIC, CODEC_VERSION, spec.level,
                                int(spec.delta) | STREAM_LAYOUTS.index(layout) << 1, spec.group, T, spec.fingerprint)
    out = []
    for c in range(N):
        payloads = []
        for j in range(c * lengths.size, (c + 1) * lengths.size, S):   # the group's streams j .. j+S-1
            payloads.append(b"".join(varint(int(n)) for n in nbytes[j:j + S - 1])
                            + data[ends[j] - nbytes[j]:ends[j + S - 1]])
        out.append(header + b"".join(varint(len(p)) for p in payloads) + b"".join(payloads))
    return out


def codec_encode(X, spec: CodecSpec, layout: str | None = None) -> bytes:
    """One context's KV (T, L, 2, C) -> its bitstream (codec_encode_many)."""
    X = np.asarray(X, np.float32)
    if X.ndim != 4:
        raise ValueError(f"need KV of shape (T, {', '.join(map(str, spec.shape))}) with 0 < T < 65536")
    return codec_encode_many(X[None], spec, layout)[0]


def codec_header(data: bytes, lengths: bool = True) -> dict:
    """Parse the header and (`lengths`) the group lengths: what a decoder learns from the bitstream alone. The
    token count is believed only as far as the bytes can carry it: each group's length takes a byte at least."""
    if len(data) < _CODEC_HEADER.size:
        raise CorruptStream("shorter than a codec header")
    magic, version, level, flags, group, T, fp = _CODEC_HEADER.unpack_from(data)
    if (magic != CODEC_MAGIC or version != CODEC_VERSION or flags >> 1 >= len(STREAM_LAYOUTS) or group == 0
            or T == 0):
        raise CorruptStream("not a codec bitstream of this version")
    h = {"level": level, "delta": bool(flags & 1), "layout": STREAM_LAYOUTS[flags >> 1], "group": group,
         "tokens": T, "fingerprint": fp}
    if not lengths:
        return h
    n_groups = -(-T // group)
    if n_groups > len(data) - _CODEC_HEADER.size:
        raise CorruptStream(f"announces {T} tokens in {len(data)} bytes")
    lengths, pos = read_varints(data, _CODEC_HEADER.size, n_groups, "group lengths")
    if pos + sum(lengths) != len(data):
        raise CorruptStream(f"payload is {len(data) - pos} bytes, the header announces {sum(lengths)}")
    return {**h, "group_bytes": lengths, "payload_start": pos}


def codec_decode_many(datas, specs, groups=None) -> list:
    """Bitstreams -> the quantized integers (T, L, 2, C) of each, exactly as `quantize` made them.
    `specs`: one CodecSpec or several (e.g. every level of a model); each header's fingerprint picks
    the one its data was coded with. `groups`: decode only these groups (the other rows stay 0).
    The streams of every bitstream coded with one spec are decoded side by side, whatever their layouts."""
    specs = [specs] if isinstance(specs, CodecSpec) else list(specs)
    out, jobs = [], {}                               # spec fingerprint -> (spec, groups to decode)
    for data in datas:
        h = codec_header(data)
        spec = next((s for s in specs if s.fingerprint == h["fingerprint"]), None)
        if spec is None:
            raise ValueError(f"no codec spec with fingerprint {h['fingerprint']:08x} (another model or level)")
        q = np.zeros((h["tokens"], *spec.shape), np.int32)
        out.append(q)
        jobs.setdefault(spec.fingerprint, (spec, []))[1].extend(_group_streams(data, h, spec, q, groups))
    for spec, job in jobs.values():
        _decode_job(spec, job)
    return out


def _table_ids(T: int, spec: CodecSpec) -> np.ndarray:
    """The table of each value of T tokens that start a group, (T, L * 2 * C) (as `symbols` numbers them)."""
    n = int(np.prod(spec.shape))
    ids = np.tile(np.arange(n, dtype=np.int64), (T, 1))
    if spec.delta:
        ids[_anchor_mask(T, spec.group)] += n
    return ids


@dataclass(frozen=True)
class _Group:
    """A group of a bitstream to decode: where its values go, its streams' symbol and byte counts, its bytes."""
    q: np.ndarray          # the bitstream's integers, (T, L * 2 * C)
    rows: slice            # the group's tokens in q
    layout: str
    order_of: object       # -> its streams' symbols in q's group rows, flat (_stream_order; made when needed)
    lengths: np.ndarray    # symbols of each stream
    nbytes: np.ndarray     # bytes of each stream
    data: np.ndarray       # the streams' bytes (uint8)


def _group_streams(data: bytes, h: dict, spec: CodecSpec, q, groups) -> list:
    """The groups of a bitstream (all, or `groups`) to decode; every group's stream lengths read at once
    (read_varint_runs)."""
    G, T = h["group"], h["tokens"]
    S, n = _layout_streams(spec)[h["layout"]], int(np.prod(spec.shape))
    whole = functools.cache(lambda: _stream_order(T, spec, h["layout"])[0])   # the channel layout needs none
    buf = np.frombuffer(data, np.uint8)
    start = np.cumsum([h["payload_start"]] + h["group_bytes"])
    n_groups = len(h["group_bytes"])
    gs = np.arange(n_groups) if groups is None else np.asarray(list(groups), np.int64).reshape(-1)
    if gs.size and not np.all((0 <= gs) & (gs < n_groups)):
        raise IndexError(f"the bitstream has groups 0..{n_groups - 1}")
    counts, pos = read_varint_runs(buf, start[gs], S - 1, "stream lengths")
    last = start[gs + 1] - pos - counts.sum(1)
    if np.any(last < 0):
        raise CorruptStream(f"group {gs[np.argmax(last < 0)]}: its streams are longer than the group")
    counts = np.concatenate([counts, last[:, None]], axis=1)
    flat = q.reshape(T, n)

    def group(i: int, g: int) -> _Group:
        rows = slice(g * G, min(T, g * G + G))
        m = rows.stop - rows.start                 # the group's tokens: each of its S streams holds m * n / S symbols
        return _Group(flat, rows, h["layout"], lambda: whole()[g * G * n:g * G * n + m * n] - g * G * n,
                      np.full(S, m * n // S), counts[i], buf[pos[i]:start[g + 1]])
    return [group(i, g) for i, g in enumerate(gs.tolist())]


def _decode_job(spec: CodecSpec, job: list):
    """Decode the groups of several bitstreams at once, into their arrays. In the channel layout a group's
    streams are the columns of its rows of values (one per (layer, K/V, channel), one symbol per token): the
    groups of one length are decoded as one matrix of lanes, read and written in place (coder_parallel.
    decode_lanes). The other groups' streams are laid end to end for decode_streams (or the serial coder)."""
    L, _, C = spec.shape
    offset = np.concatenate([np.repeat(np.asarray(spec.radius).ravel(), C), np.full(L * 2 * C, ANCHOR_MAX)])
    columns = [g for g in job if g.layout == "channel"]
    if coder_for(sum(len(g.lengths) for g in columns)) != "parallel":
        columns = []
    by_length = {}
    for g in columns:
        by_length.setdefault(g.rows.stop - g.rows.start, []).append(g)
    for m, gs in by_length.items():
        ids = _table_ids(m, spec)
        syms = decode_lanes(np.concatenate([g.data for g in gs]), np.concatenate([g.nbytes for g in gs]), ids,
                            spec.stack).reshape(m, len(gs), -1)
        off = offset[ids].astype(np.int32)
        for k, g in enumerate(gs):
            np.subtract(syms[:, k], off, out=g.q[g.rows])
    rest = [g for g in job if not (columns and g.layout == "channel")]
    if not rest:
        return
    orders = [g.order_of() for g in rest]
    ids = np.concatenate([_table_ids(g.rows.stop - g.rows.start, spec).reshape(-1)[o] for g, o in zip(rest, orders)])
    syms = _decode_any(np.concatenate([g.data for g in rest]), np.concatenate([g.nbytes for g in rest]),
                       np.concatenate([g.lengths for g in rest]), spec, ids)
    values, at = syms - offset[ids], 0
    for g, o in zip(rest, orders):
        g.q[g.rows].reshape(-1)[o] = values[at:at + o.size]
        at += o.size


def codec_decode(data: bytes, specs, groups=None) -> np.ndarray:
    """One bitstream -> its quantized integers (T, L, 2, C) (codec_decode_many)."""
    return codec_decode_many([data], specs, groups)[0]


def uniform_quantize(X, bits: int, scale: np.ndarray) -> np.ndarray:
    """The baselines: fixed-length symmetric `bits`-bit codes with a step per channel
    (scale = largest |value| on calibration / (2^(bits-1) - 1)). Returns the dequantized KV."""
    m = (1 << (bits - 1)) - 1
    return (np.clip(np.rint(np.asarray(X, np.float32) / scale), -m, m) * scale).astype(np.float32)


def coded_size(spec: CodecSpec, X) -> dict:
    """Contexts X (N, T, L, 2, C) really coded to bitstreams, one per context: bytes per token (every
    byte, header included), bits per value, and whether each decodes bit for bit to quantize(X)."""
    X = np.asarray(X, np.float32)
    streams = codec_encode_many(X, spec)
    exact = all(np.array_equal(q, x) for q, x in zip(codec_decode_many(streams, spec), quantize(X, spec)))
    n_bytes = sum(map(len, streams)) / (len(streams) * X.shape[1])
    return {"bytes_per_token": n_bytes, "bits_per_value": 8 * n_bytes / X[0, 0].size, "roundtrip_exact": exact}


def kv_rms(X) -> np.ndarray:
    """RMS of each (layer, K/V) over every token and channel: (L, 2)."""
    X = np.asarray(X, np.float64)
    return np.sqrt((X ** 2).mean(axis=tuple(range(X.ndim - 3)) + (X.ndim - 1,)))


def codec_bits(spec: CodecSpec, X) -> float:
    """Ideal arithmetic-coded bits of contexts X (N, T, L, 2, C) under the spec's tables."""
    syms, ids = symbols(quantize(X, spec), spec)
    return ideal_bits(syms.ravel(), list(spec.tables), ids.ravel())


def spec_to_dict(spec: CodecSpec) -> dict:
    """A CodecSpec as flat arrays: steps, anchor_scale, radius, and its thousands of tables as one array of
    their CDFs end to end (cdf) and one of their lengths (sizes), which load in a blink where a list of
    lists takes seconds; with delta, level and group. What a checkpoint stores (as tensors or, through
    present.plain, lists) and what a restarted engine reads as JSON (each array's .tolist())."""
    return {"steps": np.asarray(spec.steps, np.float32), "anchor_scale": np.asarray(spec.anchor_scale, np.float32),
            "radius": np.asarray(spec.radius, np.int64), "delta": bool(spec.delta), "level": int(spec.level),
            "group": int(spec.group), "sizes": np.array([len(t.cdf) for t in spec.tables], np.int64),
            "cdf": np.array([c for t in spec.tables for c in t.cdf], np.int64)}


def spec_from_dict(d: dict) -> CodecSpec:
    """spec_to_dict's inverse; each array given as a numpy array, a CPU tensor or a (nested) list."""
    sizes, cdf = np.asarray(d["sizes"], np.int64).tolist(), np.asarray(d["cdf"], np.int64).tolist()
    ends = np.cumsum(sizes, dtype=np.int64).tolist()
    return CodecSpec(steps=np.asarray(d["steps"], np.float32), delta=bool(d["delta"]),
                     anchor_scale=np.asarray(d["anchor_scale"], np.float32), radius=np.asarray(d["radius"], np.int64),
                     tables=tuple(FreqTable(tuple(cdf[e - n:e])) for e, n in zip(ends, sizes)),
                     level=int(d["level"]), group=int(d["group"]))


# ====================================================================== 2. Levels and the recipe
LEVEL_FACTOR = 2 ** 0.5    # level i uses the measured steps x LEVEL_FACTOR^i (level 0 finest): each level
                           # about half a bit per value cheaper
N_LEVELS = 4
RECIPE_GROUP_FACTOR = 2.0  # recipe: layers in 3 groups (shallow, middle, deep), each step 2x the one
                           # before (LMCache's CacheGen config: 32 bins early, 16 bins later layers)


def layer_groups(n_layers: int, n_groups: int = 3) -> np.ndarray:
    """(L,) 0 .. n_groups-1: the group of each layer, shallow to deep, in groups of (nearly) equal size."""
    return np.concatenate([np.full(len(g), i) for i, g in enumerate(np.array_split(np.arange(n_layers), n_groups))])


def level_specs(Xc, steps):
    """The measured codec's N_LEVELS specs fitted on calibration KV Xc at level 0's steps: deltas or raw
    values, whichever codes Xc in fewer bits; level i uses steps x LEVEL_FACTOR^i.
    -> (specs finest first, {delta: calibration bits at level 0}, level 0's spec in the other mode)."""
    fitted = {d: fit_codec(Xc, steps, d) for d in (True, False)}
    bits = {d: codec_bits(spec, Xc) for d, spec in fitted.items()}
    delta = bool(bits[True] < bits[False])
    specs = [fitted[delta]] + [fit_codec(Xc, steps * LEVEL_FACTOR ** i, delta, level=i) for i in range(1, N_LEVELS)]
    return specs, bits, fitted[not delta]


def recipe_steps(rms, base: float) -> np.ndarray:
    """CacheGen's layer-wise quantization as published: layers in three groups, shallow to deep, the
    step (in units of each (layer, K/V)'s RMS) growing by RECIPE_GROUP_FACTOR per group. (L, 2)."""
    rms = np.asarray(rms, np.float64)
    return rms * base * RECIPE_GROUP_FACTOR ** layer_groups(len(rms))[:, None]


MATCH_HALVINGS = 12        # match_bytes: halvings of log(step)'s bracket (cached studies are keyed by it)


def match_bytes(bits_of, target_bits: float, lo: float = 1e-4, hi: float = 1e2, iters: int = MATCH_HALVINGS):
    """The base step whose codec codes its KV in target_bits (bits_of(base) -> bits): bisection of
    log(base) in [lo, hi]. A halved step costs about one bit per value; 12 halvings of the bracket (its
    20 octaves down to 0.005 of one) put the size within about 0.005 bits per value of the target.
    A target out of reach gives the bracket's end nearest to it (the tables print the size reached)."""
    a, b = lo, hi
    for _ in range(iters):
        mid = math.sqrt(a * b)
        a, b = (mid, b) if bits_of(mid) > target_bits else (a, mid)
    return math.sqrt(a * b)

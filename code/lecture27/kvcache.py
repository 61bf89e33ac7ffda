"""The lecture's KV toolbox: the KV ledger (section 1), the arithmetic coder and the CacheGen-style
codec (sections 2-3), and `shift_kv` (section 4). Pure functions that return data; the numbered
scripts print and plot.

Sections of this file (each owned by one part of the lecture):
  1. KV ledger               -- sizes, a GPU's KV per day, fetch vs recompute, storage economics
  2. Arithmetic coder        -- static-table integer arithmetic coding
  3. CacheGen-style codec    -- anchor + delta, per-layer quantization, per-(channel, layer) tables
  4. shift_kv                -- move a precomputed chunk's K to new positions (RoPE composes)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

# =============================================================================== 1. KV ledger
# (section 1: owned by the time-model / 01_kv_ledger work)
# The lecture's "KV ledger": how big a context's KV is, how much a GPU makes per day, whether fetching
# it beats recomputing it (the break-even bandwidth), and whether storing it pays. Times come from
# common.timemodel; prices and tier bandwidths are documented inputs.
from common import timemodel as tm  # noqa: E402

SECONDS_PER_DAY = 86_400
HOURS_PER_YEAR = 365 * 24

# Where a stored KV cache is fetched from: read bandwidth into the serving node, bytes/s.
TIERS = {
    "CPU DRAM": 64e9,             # one PCIe Gen5 x16 link, 64 GB/s each way (H100 SXM datasheet)
    "local NVMe": 7e9,            # one PCIe Gen4 NVMe SSD, ~7 GB/s sequential read (e.g. Samsung PM1733 datasheet)
    "RDMA network": 50e9,         # one 400 Gb/s InfiniBand NDR NIC (NVIDIA ConnectX-7)
    "cross-cloud 10 Gb/s": 1.25e9,  # a 10 Gb/s wide-area link (the handout's example, §1.4)
}


def kv_bytes(model, n_tokens, bytes_per_value=2) -> int:
    """Bytes of KV for n_tokens tokens of context."""
    return tm.kv_bytes_per_token(model, bytes_per_value) * int(n_tokens)


def kv_layout(model) -> dict:
    """What one token caches per layer: K/V heads x head dim, or MLA's latent width."""
    m = tm.get_model(model)
    return {"layers": m.n_layers, "kv_heads": m.n_kv_heads if not m.kv_latent else None,
            "head_dim": m.head_dim if not m.kv_latent else None, "mla_latent": m.kv_latent or None}


def gpu_day_bytes(model, tokens_per_s, bytes_per_value=2) -> float:
    """KV one GPU produces in a day at a given generation throughput (prompt + output tokens/s)."""
    return tokens_per_s * tm.kv_bytes_per_token(model, bytes_per_value) * SECONDS_PER_DAY


def fetch_time(nbytes, bytes_per_s) -> float:
    return nbytes / bytes_per_s


def breakeven_bandwidth(model, gpu, n_ctx, n_gpus=1, compression=1.0, bytes_per_value=2) -> float:
    """Bytes/s above which fetching a stored context's KV beats recomputing it:
    (KV bytes / compression ratio) / recompute time."""
    return kv_bytes(model, n_ctx, bytes_per_value) / compression / tm.prefill_time(model, gpu, n_ctx, 0, n_gpus)


def fetch_or_recompute(model, gpu, n_gpus, contexts, tiers=TIERS, compression=1.0, bytes_per_value=2):
    """One row per context length: KV bytes, recompute time, break-even bandwidth, fetch time per tier."""
    rows = []
    for n in contexts:
        nbytes = kv_bytes(model, n, bytes_per_value)
        t_re = tm.prefill_time(model, gpu, n, 0, n_gpus)
        rows.append({"context": n, "kv_bytes": nbytes, "recompute_s": t_re,
                     "breakeven_bytes_per_s": nbytes / compression / t_re,
                     "fetch_s": {name: fetch_time(nbytes / compression, bw) for name, bw in tiers.items()}})
    return rows


def slides_economics(gpu_hour_usd, gpus_per_node, storage_tb_per_node, storage_usd_per_tb_hour,
                     hit_saves, hit_rate, nodes, years) -> dict:
    """The slides' account of storing KV (all inputs are the slides' assumptions except hit_saves).
    A node pays for its GPUs and for its storage tier every hour. A request that hits the cache saves
    `hit_saves` of its GPU time (not all of it: the fetch and the decode remain). Storage pays for
    itself once hit_rate * hit_saves * GPU cost >= storage cost."""
    node_usd_h = gpu_hour_usd * gpus_per_node
    storage_usd_h = storage_tb_per_node * storage_usd_per_tb_hour
    hours = years * HOURS_PER_YEAR
    saved = hit_rate * hit_saves * node_usd_h * hours * nodes      # GPU time saved, $
    storage = storage_usd_h * hours * nodes                       # storage paid, $
    return {
        "node_usd_per_h": node_usd_h, "storage_usd_per_h": storage_usd_h, "hours": hours,
        "breakeven_if_hit_saves_all": storage_usd_h / node_usd_h,  # a hit saves 100% of the GPU time
        "breakeven_hit_rate": storage_usd_h / (node_usd_h * hit_saves),
        "gpu_time_saved_usd": saved, "storage_usd": storage,
        "net_usd": saved - storage,                                # reading 1: "$33M" is net of storage
        "net_if_33m_read_as_gross_usd": (saved - storage) - storage,  # reading 2: net taken as gross, storage paid again
    }


def context_economics(model, gpu, n_gpus, n_ctx, gpu_hour_usd, storage_usd_per_tb_hour,
                      bytes_per_value=2) -> dict:
    """This lecture's own account for one stored context: what an hour of storage costs, what one hit
    saves (the recompute time of the whole node), and how many hits per hour pay for the storage."""
    nbytes = kv_bytes(model, n_ctx, bytes_per_value)
    storage_usd_h = nbytes / 1e12 * storage_usd_per_tb_hour
    t_re = tm.prefill_time(model, gpu, n_ctx, 0, n_gpus)
    hit_saves_usd = t_re / 3600 * gpu_hour_usd * n_gpus
    return {"context": n_ctx, "kv_bytes": nbytes, "recompute_s": t_re, "storage_usd_per_h": storage_usd_h,
            "hit_saves_usd": hit_saves_usd, "breakeven_hits_per_h": storage_usd_h / hit_saves_usd}


# ========================================================================= 2. Arithmetic coder
# (section 3.3: owned by the codec work)
# A range coder: integer arithmetic coding that emits whole bytes. The code value is a number in
# [0, 1) written in base 256; the coder keeps an interval [low, low + rng) of it, seen through a
# AC_STATE_BITS-wide window. Each symbol narrows the interval to its slice of the table's CDF (width
# rng * p, so it costs -log2 p bits). When the top byte of the window is settled it is shifted out
# and the window slides 8 bits. "Settled" has one catch, the carry: low + something can still
# overflow into bytes already shifted out. So the last settled byte is held back (`cache`) together
# with a run of 0xFF bytes after it (`pending`, the byte-wise form of the pending bits of
# bit-wise coders); a carry turns them into cache + 1, 0x00, 0x00, ...
#
# API. Symbols are integers 0..K-1 of a table's alphabet (map signed values with an offset first).
#   table = make_table(counts)               counts or probabilities -> FreqTable (16-bit CDF)
#   data = encode(symbols, table)            one table for every symbol -> bytes
#   syms = decode(data, table, n)            -> int64 array of n symbols
#   encode(symbols, tables, table_ids)       per-symbol tables: symbol i uses tables[table_ids[i]]
#   decode(data, tables, n, table_ids)       (e.g. one table per (channel, layer) group)
#   ideal_bits(symbols, table[s], [ids])     -sum log2 p under the same quantized tables
# The bytes are the bare code value: the decoder must be given n, the tables and the table ids.
import bisect  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402

AC_PRECISION = 16       # a table's frequencies sum to 2^16: the rarest symbol has p = 2^-16
AC_TOTAL = 1 << AC_PRECISION
AC_STATE_BITS = 48      # rng stays in [2^40, 2^48], so `rng >> AC_PRECISION` loses < 2^-24 of
_AC_SHIFT = AC_STATE_BITS - 8  # the interval per symbol (< 1e-7 bits)
_AC_TOP, _AC_MASK, _AC_FF = 1 << _AC_SHIFT, (1 << AC_STATE_BITS) - 1, 0xFF << _AC_SHIFT


class CorruptStream(ValueError):
    """The bytes cannot have come from `encode` with these tables."""


@dataclass(frozen=True)
class FreqTable:
    """A static quantized CDF: symbol s (0 <= s < size) owns [cdf[s], cdf[s+1]) of [0, AC_TOTAL)."""
    cdf: tuple

    @property
    def size(self) -> int:
        return len(self.cdf) - 1

    def probs(self) -> np.ndarray:
        return np.diff(self.cdf) / AC_TOTAL


def make_table(counts) -> FreqTable:
    """Quantize counts or probabilities of symbols 0..K-1 to integer frequencies that sum to AC_TOTAL,
    each at least 1 (no symbol is impossible, so any symbol of the alphabet can be coded)."""
    p = np.asarray(counts, dtype=np.float64).ravel()
    if not 0 < p.size <= AC_TOTAL or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ValueError(f"need 1..{AC_TOTAL} finite non-negative counts, not all zero")
    f = np.maximum(1, np.round(p / p.sum() * AC_TOTAL)).astype(np.int64)
    excess = int(f.sum()) - AC_TOTAL              # rounding error: settle it on the largest entries
    for s in np.argsort(-f, kind="stable"):
        take = min(excess, int(f[s]) - 1)         # a shortfall (excess < 0) all goes to the largest
        f[s] -= take
        excess -= take
        if excess == 0:
            break
    return FreqTable(tuple([0] + np.cumsum(f).tolist()))


def _ac_inputs(symbols, tables, table_ids):
    """`tables` is one FreqTable for every symbol, or a list of FreqTables with `table_ids[i]`
    naming the table of symbol i. -> (symbols, table ids, list of tables) as arrays, validated."""
    syms = np.asarray(symbols).ravel()
    if isinstance(tables, FreqTable):
        if table_ids is not None:
            raise ValueError("table_ids given with a single table")
        tables, ids = [tables], np.zeros(syms.size, np.int64)
    else:
        ids = np.asarray(table_ids).ravel()
        if ids.size != syms.size or (ids.size and (ids.min() < 0 or ids.max() >= len(tables))):
            raise ValueError("table_ids must give one valid table index per symbol")
    sizes = np.array([t.size for t in tables])
    if syms.size and (syms.dtype.kind not in "iu" or syms.min() < 0 or np.any(syms >= sizes[ids])):
        raise ValueError("symbols must be integers within their table's alphabet")
    return syms, ids, tables


def _shift_low(low, cache, pending, out):
    """Shift the top byte of `low` out of the window (held back until no carry can reach it)."""
    if low < _AC_FF or low > _AC_MASK:            # top byte below 0xFF, or a carry just came
        carry = low >> AC_STATE_BITS
        out.append(cache + carry)
        out.extend(((0xFF + carry) & 0xFF,) * pending)
        cache, pending = (low >> _AC_SHIFT) & 0xFF, 0
    else:                                         # top byte 0xFF: a carry could still flip it
        pending += 1
    return (low << 8) & _AC_MASK, cache, pending


def encode(symbols, tables, table_ids=None) -> bytes:
    """Code integer symbols with one table, or with per-symbol tables (tables[table_ids[i]]).
    The bytes hold only the code value: decoding needs n and the same tables and ids."""
    syms, ids, tables = _ac_inputs(symbols, tables, table_ids)
    cdfs, out = [t.cdf for t in tables], bytearray()
    low, rng, cache, pending = 0, 1 << AC_STATE_BITS, 0, 0
    for s, t in zip(syms.tolist(), ids.tolist()):
        cdf = cdfs[t]
        r = rng >> AC_PRECISION
        low += r * cdf[s]                         # move to the symbol's slice ...
        rng = r * (cdf[s + 1] - cdf[s])           # ... of width rng * p
        while rng < _AC_TOP:
            low, cache, pending = _shift_low(low, cache, pending, out)
            rng <<= 8
    # finish with the value in [low, low + rng) that has the most trailing zero bits (rng >= 2^40
    # guarantees a multiple of 2^40); the decoder reads bytes past the end as zeros, so strip them
    for b in range(AC_STATE_BITS, _AC_SHIFT - 1, -1):
        v = -(-low >> b) << b                     # low rounded up to a multiple of 2^b
        if v < low + rng:
            break
    low = v
    for _ in range(2):
        low, cache, pending = _shift_low(low, cache, pending, out)
    return bytes(out[1:]).rstrip(b"\0")           # out[0] is the byte above the window: always 0


def decode(data: bytes, tables, n: int, table_ids=None) -> np.ndarray:
    """Inverse of `encode`: the n symbols (int64). Corrupted or truncated data raises CorruptStream
    or gives a deterministic wrong result; it always stops after n symbols."""
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError("n must be a non-negative integer")
    _, ids, tables = _ac_inputs(np.zeros(n, np.int64), tables, table_ids)
    cdfs, buf, out = [t.cdf for t in tables], bytes(data), [0] * n
    pos, end = AC_STATE_BITS // 8, len(buf)
    code = int.from_bytes(buf[:pos].ljust(pos, b"\0"), "big")  # code value minus low, in the window
    rng = 1 << AC_STATE_BITS
    for i, t in enumerate(ids.tolist()):
        cdf = cdfs[t]
        r = rng >> AC_PRECISION
        v = code // r                             # where the code value falls in [0, AC_TOTAL)
        if v >= AC_TOTAL:
            raise CorruptStream(f"symbol {i}: the code value lies outside every symbol's slice")
        s = bisect.bisect_right(cdf, v) - 1
        code -= r * cdf[s]
        rng = r * (cdf[s + 1] - cdf[s])
        while rng < _AC_TOP:
            code = (code << 8) | (buf[pos] if pos < end else 0)
            pos += 1
            rng <<= 8
        out[i] = s
    return np.array(out, dtype=np.int64)


def ideal_bits(symbols, tables, table_ids=None) -> float:
    """The ideal code length -sum log2 p(symbol) under the quantized tables, in bits (vectorized)."""
    syms, ids, tables = _ac_inputs(symbols, tables, table_ids)
    logp = np.zeros((len(tables), max(t.size for t in tables)))
    for j, t in enumerate(tables):
        logp[j, :t.size] = np.log2(t.probs())
    return float(-logp[ids, syms.astype(np.int64)].sum()) if syms.size else 0.0


EX4_PROBS = {0: 0.70, 1: 0.12, -1: 0.12, 2: 0.03, -2: 0.03}  # handout, exercise 4


def exercise4(n: int = 100_000, seed: int = 0) -> dict:
    """Exercise 4: entropy of EX4_PROBS (1.40 bits), what the coder spends per value on n samples,
    and the fixed-length code (3 bits for 5 values)."""
    values = sorted(EX4_PROBS)
    p = np.array([EX4_PROBS[x] for x in values])
    table = make_table(p)
    syms = np.random.default_rng(seed).choice(len(p), size=n, p=p)
    data = encode(syms, table)
    return {"entropy_bits": float(-(p * np.log2(p)).sum()),
            "ideal_bits_per_symbol": ideal_bits(syms, table) / n,
            "coded_bits_per_symbol": 8 * len(data) / n,
            "fixed_bits": math.ceil(math.log2(len(p))),
            "roundtrip_exact": bool(np.array_equal(decode(data, table, n), syms))}


# ===================================================================== 3. CacheGen-style codec
# (section 3.3-3.4: owned by the codec work)
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
# byte length (varint), then one arithmetic-coded payload per group.
import functools  # noqa: E402
import struct  # noqa: E402
import zlib  # noqa: E402
from dataclasses import replace  # noqa: E402

CODEC_VERSION = 1
CODEC_GROUP = 10           # tokens per group; the first is the anchor (CacheGen §5.2)
ANCHOR_BITS = 8            # the anchor is quantized alone to 8 bits (CacheGen §5.2)
ANCHOR_MAX = (1 << (ANCHOR_BITS - 1)) - 1      # symmetric: -127..127
CODEC_MAX_RADIUS = 2047    # delta / raw symbols are clipped to [-R, R], R fitted, at most this
CODEC_MAGIC = b"KV"
_CODEC_HEADER = struct.Struct("<2sBBBBHI")     # magic, version, level, flags, group, tokens, fingerprint


def kv_to_array(cache) -> np.ndarray:
    """KVCache (per layer (B, Hkv, T, hd)) -> float32 array (B, T, L, 2, C)."""
    import torch
    kv = torch.stack([torch.stack(cache.k, 1), torch.stack(cache.v, 1)], 2)  # (B, L, 2, H, T, hd)
    B, L, _, H, T, hd = kv.shape
    return kv.permute(0, 4, 1, 2, 3, 5).reshape(B, T, L, 2, H * hd).float().numpy()


def array_to_kv(X, n_kv_heads: int, pos=None):
    """Inverse of kv_to_array: (B, T, L, 2, C) or (T, L, 2, C) -> KVCache at positions pos (0..T-1)."""
    import torch
    from common.llama import KVCache
    X = torch.as_tensor(np.asarray(X, np.float32))
    X = X[None] if X.dim() == 4 else X
    B, T, L, _, C = X.shape
    t = X.reshape(B, T, L, 2, n_kv_heads, C // n_kv_heads).permute(2, 3, 0, 4, 1, 5)  # (L, 2, B, H, T, hd)
    return KVCache(k=[t[i, 0].contiguous() for i in range(L)], v=[t[i, 1].contiguous() for i in range(L)],
                   pos=torch.arange(T) if pos is None else pos)


@dataclass(frozen=True, eq=False)
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
    q = np.clip(np.rint((X - _anchor_values(a, spec)[..., owner, :, :, :]) / step), -R, R).astype(np.int32)
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
        x = x + anchor[..., np.arange(T) // spec.group, :, :, :]
        x[..., anchors, :, :, :] = anchor
    return x


def _symbols(q: np.ndarray, spec: CodecSpec):
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


def fit_codec(calib, steps, delta: bool, level: int = 0, group: int = CODEC_GROUP) -> CodecSpec:
    """Fit a codec on calibration KV (N, T, L, 2, C): the anchors' per-channel 8-bit step (largest
    |value| / 127), the symbol radius (largest |symbol| seen, plus a margin, then clipped), and one
    table per (layer, K/V, channel) from the counts of each symbol."""
    calib = np.asarray(calib, np.float32)
    L = calib.shape[-3]
    steps = np.broadcast_to(np.asarray(steps, np.float32), (L, 2)).copy()
    if not np.all(steps > 0):
        raise ValueError("quantization steps must be positive")
    anchor_scale = np.maximum(np.abs(calib).max(axis=tuple(range(calib.ndim - 3))), 1e-8) / ANCHOR_MAX
    spec = CodecSpec(steps, bool(delta), anchor_scale.astype(np.float32),
                     np.full((L, 2), CODEC_MAX_RADIUS), (), int(level), int(group))
    q = quantize(calib, spec)
    free = q if not delta else q[..., ~_anchor_mask(q.shape[-4], group), :, :, :]
    seen = np.abs(free).max(axis=tuple(range(free.ndim - 3)) + (free.ndim - 1,)) if free.size else np.zeros((L, 2))
    spec = replace(spec, radius=np.minimum(CODEC_MAX_RADIUS, np.ceil(seen * 1.25) + 2).astype(np.int64))
    syms, ids = _symbols(q, spec)  # the radius covers every value seen, so q is unchanged by it
    sizes = _table_sizes(spec)
    M = int(sizes.max())
    counts = np.bincount((ids * M + syms).ravel(), minlength=len(sizes) * M).reshape(len(sizes), M)
    tables = tuple(make_table(counts[j, :sizes[j]] + (counts[j, :sizes[j]].sum() == 0)) for j in range(len(sizes)))
    return replace(spec, tables=tables)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def codec_encode(X, spec: CodecSpec) -> bytes:
    """One context's KV (T, L, 2, C) -> bitstream: header, group lengths, one payload per group."""
    X = np.asarray(X, np.float32)
    if X.ndim != 4 or X.shape[1:] != spec.shape or not 0 < X.shape[0] < 1 << 16:
        raise ValueError(f"need KV of shape (T, {', '.join(map(str, spec.shape))}) with 0 < T < 65536")
    T = X.shape[0]
    syms, ids = _symbols(quantize(X, spec), spec)
    per_group = spec.group * syms[0].size
    payloads = [encode(syms.ravel()[i:i + per_group], spec.tables, ids.ravel()[i:i + per_group])
                for i in range(0, syms.size, per_group)]
    header = _CODEC_HEADER.pack(CODEC_MAGIC, CODEC_VERSION, spec.level, int(spec.delta), spec.group, T,
                                spec.fingerprint)
    return header + b"".join(_varint(len(p)) for p in payloads) + b"".join(payloads)


def codec_header(data: bytes) -> dict:
    """Parse the header and the group lengths: what a decoder learns from the bitstream alone."""
    if len(data) < _CODEC_HEADER.size:
        raise CorruptStream("shorter than a codec header")
    magic, version, level, flags, group, T, fp = _CODEC_HEADER.unpack_from(data)
    if magic != CODEC_MAGIC or version != CODEC_VERSION or flags > 1 or group == 0 or T == 0:
        raise CorruptStream("not a codec bitstream of this version")
    pos, lengths = _CODEC_HEADER.size, []
    for _ in range(-(-T // group)):
        n = shift = 0
        while True:
            if pos >= len(data) or shift > 28:
                raise CorruptStream("truncated group lengths")
            b = data[pos]
            pos += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        lengths.append(n)
    if pos + sum(lengths) != len(data):
        raise CorruptStream(f"payload is {len(data) - pos} bytes, the header announces {sum(lengths)}")
    return {"level": level, "delta": bool(flags), "group": group, "tokens": T, "fingerprint": fp,
            "group_bytes": lengths, "payload_start": pos}


def codec_decode(data: bytes, specs, groups=None) -> np.ndarray:
    """Bitstream -> the quantized integers (T, L, 2, C), exactly as `quantize` made them.
    `specs`: one CodecSpec or several (e.g. every level of a model); the header's fingerprint picks
    the one the data was coded with. `groups`: decode only these groups (the other rows stay 0)."""
    h = codec_header(data)
    specs = [specs] if isinstance(specs, CodecSpec) else list(specs)
    spec = next((s for s in specs if s.fingerprint == h["fingerprint"]), None)
    if spec is None:
        raise ValueError(f"no codec spec with fingerprint {h['fingerprint']:08x} (another model or level)")
    T, L, C, G = h["tokens"], spec.shape[0], spec.shape[2], spec.group
    q = np.zeros((T, L, 2, C), np.int64)
    _, ids = _symbols(q, spec)
    offsets = np.cumsum([h["payload_start"]] + h["group_bytes"])
    for g in range(len(h["group_bytes"])) if groups is None else groups:
        rows = slice(g * G, min(T, (g + 1) * G))
        gid = ids[rows]
        syms = decode(data[offsets[g]:offsets[g + 1]], spec.tables, gid.size, gid.ravel()).reshape(gid.shape)
        q[rows] = syms - spec.radius[:, :, None]
        if spec.delta:
            q[g * G] = syms[0] - ANCHOR_MAX
    return q.astype(np.int32)


def codec_roundtrip(X, spec: CodecSpec) -> tuple[bytes, np.ndarray]:
    """Encode one context and decode it again: (bitstream, decoded float32 KV)."""
    data = codec_encode(X, spec)
    return data, dequantize(codec_decode(data, spec), spec)


def uniform_quantize(X, bits: int, scale: np.ndarray) -> np.ndarray:
    """The baselines: fixed-length symmetric `bits`-bit codes with a step per channel
    (scale = largest |value| on calibration / (2^(bits-1) - 1)). Returns the dequantized KV."""
    m = (1 << (bits - 1)) - 1
    return (np.clip(np.rint(np.asarray(X, np.float32) / scale), -m, m) * scale).astype(np.float32)


# ---- measuring a codec on a model: answers read from decoded KV, the step search, the quality levels
# Accuracy of a codec = answer accuracy when the question's tokens attend to the decoded (lossy) context
# KV instead of the exact one: model(question_tokens, cache=decoded context KV).
MEASURE_TOL = 0.0          # the step search keeps calibration accuracy >= FP16's - this
STEP_NOTCH = 2.0           # the search coarsens one (layer, K/V) step by this factor at a time
STEP_START = 2.0 ** -5     # ... starting from steps of this x the RMS of that (layer, K/V)
STEP_MAX_NOTCHES = 8       # ... up to STEP_START x STEP_NOTCH^8 = 8 x RMS (where nothing is left)
LEVEL_FACTOR = 2 ** 0.5    # level i uses the measured steps x LEVEL_FACTOR^i (level 0 finest): each level
                           # about half a bit per value cheaper
N_LEVELS = 4
RECIPE_GROUP_FACTOR = 2.0  # recipe: layers in 3 groups (shallow, middle, deep), each step 2x the one
                           # before (LMCache's CacheGen config: 32 bins early, 16 bins later layers)


def answer_accuracy(model, X, questions, answers, slots=None, batch: int = 250) -> dict:
    """Question tokens (N, Tq) attend to context KV X (N, T, L, 2, C); the positions `slots` of the
    question tokens must predict answers (N, len(slots)) (default: the last position, answers (N,)).
    -> {"acc", "nll"}: mean over every answer."""
    import torch
    import torch.nn.functional as F
    n_kv = model.cfg.n_kv_heads
    slots = torch.tensor([-1] if slots is None else slots)
    correct, nll, n = 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, len(answers), batch):
            logits, _ = model(torch.as_tensor(questions[i:i + batch]), cache=array_to_kv(X[i:i + batch], n_kv))
            out = logits[:, slots].float().flatten(0, 1)
            ans = torch.as_tensor(answers[i:i + batch]).reshape(-1)
            correct += int((out.argmax(-1) == ans).sum())
            nll += float(F.cross_entropy(out, ans, reduction="sum"))
            n += ans.numel()
    return {"acc": correct / n, "nll": nll / n}


def kv_rms(X) -> np.ndarray:
    """RMS of each (layer, K/V) over every token and channel: (L, 2)."""
    X = np.asarray(X, np.float64)
    return np.sqrt((X ** 2).mean(axis=tuple(range(X.ndim - 3)) + (X.ndim - 1,)))


def codec_bits(spec: CodecSpec, X) -> float:
    """Ideal arithmetic-coded bits of contexts X (N, T, L, 2, C) under the spec's tables."""
    syms, ids = _symbols(quantize(X, spec), spec)
    return ideal_bits(syms.ravel(), list(spec.tables), ids.ravel())


def search_steps(evaluate, rms, target: float, start: float = STEP_START, notch: float = STEP_NOTCH,
                 max_notches: int = STEP_MAX_NOTCHES, progress=None):
    """Greedy search for the coarsest steps that keep the answers: steps = rms * start * notch^e.
    Each round tries coarsening each (layer, K/V) by one notch alone; a try whose accuracy drops below
    `target` freezes that entry (as does reaching max_notches). Of the tries that pass, all are taken together if that passes too,
    else only the one that hurts the answers least (lowest NLL): every notch saves about one bit per
    value, so the least harmful is the best buy. evaluate(steps) -> {"acc", "nll"}.
    Returns (steps, trace of accepted moves)."""
    rms = np.asarray(rms, np.float64)
    e = np.zeros(rms.shape, int)
    frozen = np.zeros(rms.shape, bool)
    trace = []
    while not (frozen := frozen | (e >= max_notches)).all():
        passing = []
        for lk in zip(*np.nonzero(~frozen)):
            e2 = e.copy()
            e2[lk] += 1
            r = evaluate(rms * start * notch ** e2)
            if progress is not None:
                progress.update(1)
            if r["acc"] >= target:
                passing.append((r["nll"], lk, r))
            else:
                frozen[lk] = True
        if not passing:
            break
        passing.sort(key=lambda p: p[0])
        e_all = e.copy()
        for _, lk, _ in passing:
            e_all[lk] += 1
        r_all = evaluate(rms * start * notch ** e_all) if len(passing) > 1 else passing[0][2]
        if r_all["acc"] >= target:
            e, r, moved = e_all, r_all, [lk for _, lk, _ in passing]
        else:
            e[passing[0][1]] += 1
            r, moved = passing[0][2], [passing[0][1]]
        trace.append({"moved": [[int(a), int(b)] for a, b in moved], "acc": r["acc"], "nll": r["nll"]})
    return rms * start * notch ** e, trace


def recipe_steps(rms, base: float) -> np.ndarray:
    """CacheGen's layer-wise quantization as published: layers in three groups, shallow to deep, the
    step (in units of each (layer, K/V)'s RMS) growing by RECIPE_GROUP_FACTOR per group. (L, 2)."""
    rms = np.asarray(rms, np.float64)
    groups = np.array_split(np.arange(len(rms)), 3)
    g = np.concatenate([np.full(len(layers), i) for i, layers in enumerate(groups)])
    return rms * base * RECIPE_GROUP_FACTOR ** g[:, None]


def match_bytes(make_spec, X, target_bits: float, lo: float = 1e-4, hi: float = 1e2, iters: int = 16):
    """The base step whose codec (make_spec(base) -> CodecSpec) codes X in target_bits (bisection in log)."""
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if codec_bits(make_spec(mid), X) > target_bits else (lo, mid)
    return math.sqrt(lo * hi)


def context_kv(model, contexts, batch: int = 1000) -> np.ndarray:
    """Prefill each context (N, T) from position 0 and return its exact KV (N, T, L, 2, C), float32."""
    import torch
    with torch.no_grad():
        return np.concatenate([kv_to_array(model(torch.as_tensor(contexts[i:i + batch]))[1])
                               for i in range(0, len(contexts), batch)])


def spec_to_dict(spec: CodecSpec) -> dict:
    return {"steps": spec.steps.tolist(), "delta": spec.delta, "anchor_scale": spec.anchor_scale.tolist(),
            "radius": spec.radius.tolist(), "tables": [list(t.cdf) for t in spec.tables],
            "level": spec.level, "group": spec.group}


def spec_from_dict(d: dict) -> CodecSpec:
    return CodecSpec(np.array(d["steps"], np.float32), bool(d["delta"]), np.array(d["anchor_scale"], np.float32),
                     np.array(d["radius"], np.int64), tuple(FreqTable(tuple(c)) for c in d["tables"]),
                     int(d["level"]), int(d["group"]))


def level_specs(Xc, steps):
    """The measured codec's N_LEVELS specs fitted on calibration KV Xc at level 0's steps: deltas or raw
    values, whichever codes Xc in fewer bits; level i uses steps x LEVEL_FACTOR^i.
    -> (specs finest first, {delta: calibration bits at level 0}, level 0's spec in the other mode)."""
    fitted = {d: fit_codec(Xc, steps, d) for d in (True, False)}
    bits = {d: codec_bits(spec, Xc) for d, spec in fitted.items()}
    delta = bool(bits[True] < bits[False])
    specs = [fitted[delta]] + [fit_codec(Xc, steps * LEVEL_FACTOR ** i, delta, level=i) for i in range(1, N_LEVELS)]
    return specs, bits, fitted[not delta]


CODEC_N_CALIB = 1000       # calibration documents: tables, anchor scales, the step search
CODEC_N_EVAL = 2000        # evaluation documents (another seed): the accuracy reported
CODEC_N_CODED = 200        # evaluation contexts really coded to bytes (bytes/token); the coder is exact,
                           # so accuracy is computed from quantize() on all CODEC_N_EVAL
CODEC_CALIB_SEED, CODEC_EVAL_SEED = 27_001, 27_002


def codec_study(model, calib, evalset, progress: bool = True) -> dict:
    """Fit and measure the record model's codecs. calib / evalset: (contexts (N, T), questions (N, Tq),
    answers (N, Q) [, slots (Q,): the question positions that predict them]) from different seeds. Returns JSON-able results: the measured steps and their search,
    the chosen mode (deltas or not), every level's spec, bytes/token and accuracy, the recipe's steps."""
    from tqdm import tqdm
    Xc, Xe = context_kv(model, calib[0]), context_kv(model, evalset[0])
    T = Xe.shape[1]
    fp16_c = answer_accuracy(model, Xc.astype(np.float16).astype(np.float32), *calib[1:])
    fp16_e = answer_accuracy(model, Xe.astype(np.float16).astype(np.float32), *evalset[1:])
    rms = kv_rms(Xc)
    L, C = Xc.shape[2], Xc.shape[4]
    bar = tqdm(desc="codec: step search", disable=not progress, leave=False)

    def evaluate(steps):  # raw quantization at these steps, answers on calibration documents
        spec = CodecSpec(np.asarray(steps, np.float32), False, np.ones((L, 2, C), np.float32),
                         np.full((L, 2), CODEC_MAX_RADIUS))
        return answer_accuracy(model, dequantize(quantize(Xc, spec), spec), *calib[1:])

    steps, trace = search_steps(evaluate, rms, fp16_c["acc"] - MEASURE_TOL, progress=bar)
    bar.close()
    specs_fit, bits, other = level_specs(Xc, steps)
    delta = specs_fit[0].delta

    def measure(spec):
        acc = answer_accuracy(model, dequantize(quantize(Xe, spec), spec), *evalset[1:])
        coded = [codec_encode(x, spec) for x in Xe[:CODEC_N_CODED]]
        exact = all(np.array_equal(codec_decode(d, spec), quantize(x, spec)) for d, x in zip(coded, Xe))
        n_bytes = sum(map(len, coded)) / (len(coded) * T)
        return {"bytes_per_token": n_bytes, "bits_per_value": 8 * n_bytes / (L * 2 * C),
                "accuracy": acc["acc"], "nll": acc["nll"], "roundtrip_exact": exact}

    levels, specs = [], []
    for i in tqdm(range(N_LEVELS), desc="codec: levels", disable=not progress, leave=False):
        spec = specs_fit[i]
        specs.append(spec_to_dict(spec))
        levels.append({"level": i, **measure(spec), "fp16_accuracy": fp16_e["acc"]})
    variants = {"delta" if delta else "raw": levels[0],
                "raw" if delta else "delta": measure(other)}
    # the recipe as published, at the size of level 0: deltas, 3 layer groups, finer steps in shallow layers
    base = match_bytes(lambda b: fit_codec(Xc, recipe_steps(rms, b), True), Xc, bits[delta])
    recipe = fit_codec(Xc, recipe_steps(rms, base), True)
    recipe_out = {**measure(recipe), "steps_over_rms": (recipe.steps / rms).tolist(), "spec": spec_to_dict(recipe)}
    return {"acc_fp16_calib": fp16_c["acc"], "acc_fp16": fp16_e["acc"], "nll_fp16": fp16_e["nll"],
            "rms": rms.tolist(), "steps": steps.tolist(), "steps_over_rms": (steps / rms).tolist(),
            "search": trace, "delta": bool(delta), "calib_bits": {"delta": bits[True], "raw": bits[False]},
            "levels": levels, "specs": specs, "variants": variants, "recipe": recipe_out,
            "tokens_per_context": T, "n_calib": len(calib[2]), "n_eval": len(evalset[2])}


def record_world() -> dict:
    """The record-world model of blend_world.py and its documents, as the codec study uses them:
    {"model", "ident" (the checkpoint's identity), "docs": docs(n, seed) -> (contexts (n, 24),
    questions (n, 24): "? k" for all 12 records, answers (n, 12), slots: the 12 key positions)}."""
    import torch
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import blend_world as bw
    model, meta = bw.record_model()
    slots = bw.answer_slots(bw.N_RECORDS).numpy()

    def docs(n, seed):
        rec = bw.sample_records(n, torch.Generator().manual_seed(seed))
        return rec.doc.numpy(), rec.question.numpy(), rec.answers.numpy(), slots

    return {"model": model.eval(), "ident": meta["ident"], "docs": docs}


def record_codec_study(retrain: bool = False, progress: bool = True) -> dict:
    """codec_study() on the record-world model, cached in code/checkpoints/ under a key made of the
    model checkpoint's identity, CODEC_VERSION and every constant above (refit when one changes)."""
    import torch
    from common.checkpoints import cached_result
    world = record_world()
    ident = {
        "model": world["ident"], "codec": CODEC_VERSION, "group": CODEC_GROUP, "anchor_bits": ANCHOR_BITS,
        "max_radius": CODEC_MAX_RADIUS, "search": [MEASURE_TOL, STEP_NOTCH, STEP_START, STEP_MAX_NOTCHES],
        "levels": [LEVEL_FACTOR, N_LEVELS], "recipe": RECIPE_GROUP_FACTOR,
        "docs": [CODEC_N_CALIB, CODEC_N_EVAL, CODEC_N_CODED, CODEC_CALIB_SEED, CODEC_EVAL_SEED]}

    def compute():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)        # tiny batches: one thread is faster (and the machine is shared)
        try:
            return codec_study(world["model"], world["docs"](CODEC_N_CALIB, CODEC_CALIB_SEED),
                               world["docs"](CODEC_N_EVAL, CODEC_EVAL_SEED), progress)
        finally:
            torch.set_num_threads(threads)

    return cached_result("codec-record", ident, compute, retrain, tag="codec")


def codec_levels(retrain: bool = False) -> list[dict]:
    """The measured codec's quality levels on the record-world model, level 0 finest .. level 3 coarsest:
    [{"level", "bytes_per_token", "bits_per_value", "accuracy", "fp16_accuracy"}, ...] (cached)."""
    keys = ("level", "bytes_per_token", "bits_per_value", "accuracy", "fp16_accuracy")
    return [{k: lv[k] for k in keys} for lv in record_codec_study(retrain)["levels"]]


def record_codecs(retrain: bool = False) -> list[CodecSpec]:
    """The record-world codec's specs, one per level: the tables its encoder and decoder share."""
    return [spec_from_dict(d) for d in record_codec_study(retrain)["specs"]]


# ============================================================================== 4. shift_kv
def shift_kv(k, delta, theta: float):
    """Move K (..., T, head_dim), cached after RoPE, by `delta` positions (an int, or a tensor of
    T per-token offsets): rotate once more by delta * theta^(-2i/d) (CacheBlend, appendix A).
    V carries no position and is reused as it is."""
    import torch
    from common.llama import rope

    T = k.shape[-2]
    d = delta if isinstance(delta, torch.Tensor) else torch.full((T,), float(delta))
    return rope(k, d, theta)

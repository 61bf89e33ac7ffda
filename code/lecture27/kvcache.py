"""CacheGen's coder and codec (handout §3): a static-table arithmetic coder and the CacheGen-style KV
codec built on it (anchor + delta, per-layer quantization, per-(channel, layer) tables), with its
quality levels. numpy only: pure functions on arrays that return data. Measuring a codec on a model
(the step search, the answers read from decoded KV) is codec_study.py's; the scripts print and plot.

Sections of this file:
  1. Arithmetic coder        -- static-table integer arithmetic coding (§3.3), exercise 4
  2. Parallel coder          -- the same coder on many independent streams at once (exercise 3)
  3. CacheGen-style codec    -- anchor + delta, per-layer quantization, per-(channel, layer) tables (§3.3)
  4. Levels and the recipe   -- a codec at coarser steps for streaming (§4), CacheGen's published recipe
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
import struct
import time
import zlib
from dataclasses import dataclass, replace

import numpy as np

# ============================================================================ 1. Arithmetic coder
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
    return make_tables(p[None], [p.size])[0]


def make_tables(counts, sizes) -> tuple:
    """make_table for many tables at once (a codec has one per layer, K/V and channel: 11,520 for
    SmolLM2): row j of counts (n, M) holds table j's counts in its first sizes[j] entries. Rows of one
    size are done together, as a matrix (a codec's sizes take a few dozen values)."""
    out = [None] * len(sizes)
    for rows, _, cdfs in _cdfs_by_size(np.asarray(counts, np.float64), np.asarray(sizes)):
        for j, cdf in zip(rows, cdfs.tolist()):
            out[j] = FreqTable(tuple(cdf))
    return tuple(out)


def _cdfs_by_size(counts, sizes):
    """make_tables' work, the rows of one size at a time: (those rows, their size, their CDFs)."""
    for n in np.unique(sizes):
        rows = np.flatnonzero(sizes == n)
        yield rows, n, _quantized_cdfs(counts[rows, :n])


def unseen_uniform(counts) -> np.ndarray:
    """Counts (tables, symbols) with a table that saw nothing made uniform: all ones."""
    return counts + (counts.sum(1, keepdims=True) == 0)


def _quantized_cdfs(p: np.ndarray) -> np.ndarray:
    """(m, K) counts -> (m, K + 1) CDFs, each row by make_table's rule: frequencies round(p x AC_TOTAL),
    at least 1; the rounding error is then settled on the largest entries: an excess is taken from
    them in turn (each keeps at least 1), a shortfall all goes to the largest."""
    f = np.maximum(1, np.round(p / p.sum(1, keepdims=True) * AC_TOTAL)).astype(np.int64)
    excess = (f.sum(1) - AC_TOTAL)[:, None]                       # (m, 1)
    order = np.argsort(-f, axis=1, kind="stable")                 # largest first
    fs = np.take_along_axis(f, order, 1)
    give = fs - 1
    taken_before = np.cumsum(give, 1) - give
    take = np.where(excess > 0, np.clip(excess - taken_before, 0, give),
                    np.where(np.arange(f.shape[1]) == 0, np.minimum(excess, 0), 0))
    np.put_along_axis(f, order, fs - take, 1)
    return np.concatenate([np.zeros((len(f), 1), np.int64), np.cumsum(f, 1)], 1)


def _ac_inputs(symbols, tables, table_ids, n: int | None = None):
    """`tables` is one FreqTable for every symbol, or a list of FreqTables (or a TableStack) with
    `table_ids[i]` naming the table of symbol i. -> (symbols, table ids, list of tables) as arrays, validated.
    A decoder passes no symbols and their number n."""
    syms = np.asarray(symbols).ravel()
    n = syms.size if n is None else n
    if isinstance(tables, FreqTable):
        if table_ids is not None:
            raise ValueError("table_ids given with a single table")
        tables, ids = [tables], np.zeros(n, np.int64)
    else:
        ids = np.asarray(table_ids).ravel()
        if ids.size != n or (ids.size and (ids.min() < 0 or ids.max() >= len(tables))):
            raise ValueError("table_ids must give one valid table index per symbol")
    sizes = tables.size if isinstance(tables, TableStack) else np.array([t.size for t in tables])
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
        if rng <= 0:                              # nothing can narrow to an empty slice
            raise ValueError(f"symbol {s} has a slice of zero width in its table")
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
    _, ids, tables = _ac_inputs((), tables, table_ids, n)
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
        s = min(max(bisect.bisect_right(cdf, v) - 1, 0), len(cdf) - 2)   # the slice that holds v ...
        if not cdf[s] <= v < cdf[s + 1]:          # ... unless v fell on one of zero width (a bad table)
            raise CorruptStream(f"symbol {i}: the code value lies in no symbol's slice (symbol {s}'s is empty)")
        code -= r * cdf[s]
        rng = r * (cdf[s + 1] - cdf[s])
        while rng < _AC_TOP:
            code = (code << 8) | (buf[pos] if pos < end else 0)
            pos += 1
            rng <<= 8
        out[i] = s
    return np.array(out, dtype=np.int64)


def ideal_bits(symbols, tables, table_ids=None) -> float:
    """The ideal code length -sum log2 p(symbol) under the quantized tables, in bits (vectorized: every
    table's CDF laid end to end, each symbol's frequency read as cdf[s + 1] - cdf[s] of its table)."""
    syms, ids, tables = _ac_inputs(symbols, tables, table_ids)
    stack = stack_tables(tables)
    at = stack.start[ids] + syms.astype(np.int64)
    return float(-np.log2((stack.cdf[at + 1] - stack.cdf[at]) / AC_TOTAL).sum()) if syms.size else 0.0


def exercise4(probs: dict, n: int = 100_000, seed: int = 0) -> dict:
    """Exercise 4: the entropy of a distribution of values {value: probability} (the handout's gives
    1.40 bits), what the coder spends per value on n samples, and the fixed-length code's bits."""
    values = sorted(probs)
    p = np.array([probs[x] for x in values])
    table = make_table(p)
    syms = np.random.default_rng(seed).choice(len(p), size=n, p=p)
    data = encode(syms, table)
    return {"entropy_bits": float(-(p * np.log2(p)).sum()),
            "ideal_bits_per_symbol": ideal_bits(syms, table) / n,
            "coded_bits_per_symbol": 8 * len(data) / n,
            "fixed_bits": math.ceil(math.log2(len(p))),
            "roundtrip_exact": bool(np.array_equal(decode(data, table, n), syms))}


# ========================================================================= 2. Parallel coder
# CacheGen's GPU coder runs one stream per (layer, channel), thousands of them side by side. This is
# section 1's coder written for arrays: many independent streams advance one symbol per step together,
# each stream a lane of numpy arrays (low and rng when encoding; code, rng and a read position when
# decoding). Each stream's bytes are exactly what `encode` makes of that stream alone. A step costs a
# few dozen numpy operations whatever the number of lanes, so the coder is fast only with many streams;
# and each stream ends with its own flush, so many short streams cost bytes.
#   stack = stack_tables(tables)            tables as arrays (build once per set of tables, reuse)
#   data, nbytes = encode_streams(symbols, lengths, stack, table_ids)
#                                           streams laid end to end (lengths[j] symbols each) -> their
#                                           bytes laid end to end and each stream's byte count
#   syms = decode_streams(data, nbytes, lengths, stack, table_ids)
# The encoder's one sequential detail, the carry, is settled after the loop: each step records low as
# it was before its shifts, carry bit included, and the carries of all streams are then added to the
# bytes before them at once. The decoder finds a symbol in a lookup of 256 buckets per table (the
# symbol where each bucket starts, its slice and the next one) and searches the table's cdf only where
# a bucket holds more boundaries (the rare symbols: about 1% of SmolLM2's).
_BUCKET_SHIFT = 8                         # a bucket is 2^8 of the AC_TOTAL code values
_BUCKETS = AC_TOTAL >> _BUCKET_SHIFT      # + 1 more, for a code value of AC_TOTAL (a corrupt stream)
_AC_TOP2 = 1 << (_AC_SHIFT - 8)           # rng below this: two bytes to shift (rng >= 2^24 after a symbol)
_LOOKUP_MAX_SIZE = 1 << 12               # the parallel decoder's tables: at most 4096 symbols
PARALLEL_BLOCK = 16384                    # lanes coded together: a block's arrays stay in the CPU cache


@dataclass(frozen=True, eq=False)
class TableStack:
    """Tables as arrays for the parallel coder: every table's CDF laid end to end."""
    cdf: np.ndarray        # int64: table t's cdf is cdf[start[t] : start[t] + size[t] + 1]
    start: np.ndarray
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.size)

    @functools.cached_property
    def cdf32(self) -> np.ndarray:
        return self.cdf.astype(np.int32)

    @functools.cached_property
    def width32(self) -> np.ndarray:
        """cdf[i + 1] - cdf[i]: the width of the slice that starts at cdf[i] (after a table's last
        entry: the next table's first, never read for a symbol)."""
        return np.diff(self.cdf32, append=np.int32(0))

    @functools.cached_property
    def empty_slices(self) -> bool:
        """Whether any table has a slice of zero width (make_table never makes one)."""
        inner = np.ones(self.cdf.size, bool)
        inner[self.start + self.size] = False
        return bool(np.any(self.width32[inner] <= 0))

    @functools.cached_property
    def lookup(self) -> np.ndarray:
        """(n_tables * (_BUCKETS + 1), 4) uint16: for table t and bucket b, the last symbol s whose slice
        starts at or below the bucket's first code value (at most the table's last symbol), with the
        slices of s and s + 1: s, cdf[s], cdf[s + 1] - 1, cdf[s + 2] - 1 (0 when s is the last symbol).
        The ends are stored less one to fit 16 bits; four of them are one 8-byte read for the decoder. A
        bucket with at most one boundary inside is decoded from its row alone."""
        if self.size.max(initial=0) > _LOOKUP_MAX_SIZE:
            raise ValueError(f"the parallel decoder takes tables of at most {_LOOKUP_MAX_SIZE} symbols")
        n, nb = len(self.size), _BUCKETS + 1
        upper = np.ones(self.cdf.size, bool)
        upper[self.start] = False                                          # cdf[1..K] of every table
        bucket = np.clip(-(-self.cdf[upper] >> _BUCKET_SHIFT), 0, _BUCKETS)  # first bucket at or above
        table = np.repeat(np.arange(n), self.size)
        below = np.bincount(table * nb + bucket, minlength=n * nb).reshape(n, nb).cumsum(1)
        s = np.minimum(below, self.size[:, None] - 1)
        at, cdf = self.start[:, None] + s, np.append(self.cdf, 0)
        after = np.where(s + 1 < self.size[:, None], cdf[at + 2] - 1, 0)
        rows = np.stack([s, np.minimum(cdf[at], 0xFFFF), cdf[at + 1] - 1, after], -1)
        return np.clip(rows, 0, 0xFFFF).astype(np.uint16).reshape(-1, 4)

    @functools.cached_property
    def keys(self) -> np.ndarray:
        """Every table's cdf entries as table << 17 | cdf, ascending: a code value v of table t lies in
        the slice of the last entry at or below t << 17 | v (np.searchsorted), for the buckets `lookup`
        cannot decide alone."""
        return np.repeat(np.arange(len(self.size)), self.size + 1) << (AC_PRECISION + 1) | self.cdf


def stack_tables(tables) -> TableStack:
    """A FreqTable, a sequence of FreqTables, or a TableStack (returned as it is) -> TableStack."""
    if isinstance(tables, TableStack):
        return tables
    tables = [tables] if isinstance(tables, FreqTable) else tables
    size = np.array([len(t.cdf) - 1 for t in tables], np.int64)
    cdf = np.fromiter(itertools.chain.from_iterable(t.cdf for t in tables), np.int64, int((size + 1).sum()))
    return TableStack(cdf, np.cumsum(size + 1) - (size + 1), size)


@dataclass(frozen=True)
class _Lanes:
    """Streams as lanes, longest first, so that the streams still running at step i are the first
    active[i] lanes. Values of the streams laid end to end go to a (steps, lanes) matrix and back."""
    lengths: np.ndarray
    order: np.ndarray      # the stream in each lane
    active: list

    @staticmethod
    def of(lengths):
        order = np.argsort(-lengths, kind="stable")
        n_steps = int(lengths[order[0]]) if len(order) else 0
        return _Lanes(lengths, order, np.searchsorted(-lengths[order], -np.arange(n_steps), "left").tolist())

    @functools.cached_property
    def equal(self) -> bool:
        return bool(np.all(self.lengths == len(self.active)))

    @functools.cached_property
    def where(self) -> np.ndarray:
        """Where the q-th symbol of the streams laid end to end sits in the flattened matrix."""
        lane = np.empty_like(self.order)
        lane[self.order] = np.arange(len(self.order))
        step = np.arange(self.lengths.sum()) - np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
        return step * len(self.order) + np.repeat(lane, self.lengths)

    def to_steps(self, values) -> np.ndarray:
        S = len(self.lengths)
        if self.equal:
            return np.ascontiguousarray(values.reshape(S, len(self.active)).T)
        out = np.zeros((len(self.active), S), values.dtype)
        out.reshape(-1)[self.where] = values
        return out

    def from_steps(self, matrix, dtype=None) -> np.ndarray:
        if self.equal:
            return np.array(matrix.T, dtype, order="C").ravel()
        return matrix.reshape(-1)[self.where].astype(dtype or matrix.dtype, copy=False)

    def blocks(self):
        """(lane slice, running lanes at each step within it) of each block of PARALLEL_BLOCK lanes."""
        S = len(self.lengths)
        for b in range(0, S, PARALLEL_BLOCK):
            e = min(S, b + PARALLEL_BLOCK)
            yield slice(b, e), [min(max(a - b, 0), e - b) for a in self.active]


def _stream_lengths(lengths, total: int | None = None) -> np.ndarray:
    lengths = np.asarray(lengths).ravel()
    if lengths.dtype.kind not in "iu" or np.any(lengths < 0) or total not in (None, lengths.sum()):
        raise ValueError("lengths must be non-negative integers that add up to the number of symbols")
    return lengths.astype(np.int64)


def encode_streams(symbols, lengths, tables, table_ids=None):
    """Code the streams laid end to end in `symbols` (stream j: the next lengths[j] symbols), all at
    once. -> (their bytes laid end to end, each stream's byte count): stream j's bytes are
    encode(its symbols, tables, its table ids)."""
    syms, ids, tables = _ac_inputs(symbols, tables, table_ids)
    lengths, stack = _stream_lengths(lengths, syms.size), stack_tables(tables)
    at = stack.start[ids] + syms
    lo, width = stack.cdf32[at], stack.width32[at]
    if stack.empty_slices and np.any(width <= 0):
        raise ValueError(f"symbol {syms[np.argmax(width <= 0)]} has a slice of zero width in its table")
    lanes = _Lanes.of(lengths)
    LO, W = lanes.to_steps(lo), lanes.to_steps(width)
    tops, shifts = np.zeros(LO.shape, np.int32), np.zeros(LO.shape, np.int8)
    low, rng = np.zeros(len(lengths), np.int64), np.full(len(lengths), 1 << AC_STATE_BITS, np.int64)
    for b, counts in lanes.blocks():
        _encode_block(low[b], rng[b], LO[:, b], W[:, b], tops[:, b], shifts[:, b], counts)
    return _settle(tops, shifts, _final_value(low, rng), lanes.order)


def _encode_block(low, rng, LO, W, tops, shifts, counts):
    """Section 1's encoding loop, one step for every running lane at once. Each step records the top
    17 bits of low before its shifts (0, 1 or 2 bytes): the carry bit that `encode` would pass on to
    the byte before, then the two bytes it may shift out. The carry bit then leaves low at once."""
    for i, a in enumerate(counts):
        if a == 0:
            break
        low_, rng_ = low[:a], rng[:a]
        r = rng_ >> AC_PRECISION
        low_ += r * LO[i, :a]
        np.multiply(r, W[i, :a], out=rng_)
        bits = _shift_bits(rng_)
        np.right_shift(bits, 3, out=shifts[i, :a], casting="unsafe")
        np.right_shift(low_, _AC_SHIFT - 8, out=tops[i, :a], casting="unsafe")
        low_ <<= bits
        low_ &= _AC_MASK
        rng_ <<= bits


def _shift_bits(rng) -> np.ndarray:
    """Bits to shift after a symbol (int64): 16 below 2^32, 8 below 2^40, else 0."""
    bits = (rng < _AC_TOP) * 8
    bits += (rng < _AC_TOP2) * 8
    return bits


def _final_value(low, rng) -> np.ndarray:
    """Each lane's final value, as `encode` picks it: the number in [low, low + rng) with the most
    trailing zero bits, of at least 2^40 and at most 2^48: the multiple of 2^b at or above low, where
    bit b is the highest in which low - 1 and low + rng - 1 differ (frexp gives the bit length)."""
    differ = np.where(low > 0, (low - 1) ^ (low + rng - 1), 1 << 60)
    b = np.clip(np.frexp(differ.astype(np.float64))[1] - 1, _AC_SHIFT, AC_STATE_BITS)
    return -(-low >> b) << b


def _settle(tops, shifts, final, order):
    """Each lane's bytes: each step's shifted bytes, then the final value's top byte; every carry
    added to the byte before its step (and on through a run of 0xFF: between two shifts low can
    carry only once, so a byte gets at most one); trailing zeros stripped as `encode` does.
    -> (bytes of the lanes in stream order, laid end to end; counts)."""
    S, n = len(order), tops.shape[0]
    lane = np.empty_like(order)
    lane[order] = np.arange(S)
    if np.any(lane != np.arange(S)):                           # lanes back in stream order
        tops, shifts, final = tops[:, lane], shifts[:, lane], final[lane]
    top, k = tops.T, shifts.T                                 # (lanes, steps)
    slots, taken = np.zeros((S, n + 1, 2), np.uint8), np.zeros((S, n + 1, 2), bool)
    slots[:, :n, 0], slots[:, :n, 1], slots[:, n, 0] = top >> 8, top, final >> _AC_SHIFT   # bytes (mod 256)
    taken[:, :n, 0], taken[:, :n, 1], taken[:, n, 0] = k >= 1, k == 2, True
    out = slots[taken]
    steps = np.ones((S, n + 1), np.int8)                       # bytes of each step, the final one's 1
    steps[:, :n] = k
    carry = np.ones((S, n + 1), bool)
    carry[:, :n], carry[:, n] = top >> 16, final >> AC_STATE_BITS
    c = np.flatnonzero(carry)
    before = np.cumsum(steps.ravel(), dtype=np.int64)[c] - steps.ravel()[c] - 1   # the byte before each
    out[before] += 1                                           # (mod 256: 0 means it was 0xFF)
    _carry_through_ff(out, before[out[before] == 0])
    count = steps.sum(1, dtype=np.int64)
    last = np.cumsum(count) - 1
    end = last.copy()
    for _ in range(4):                                         # a few zeros at most, as a rule ...
        zero = (end > last - count) & (out[end] == 0)
        end[zero] -= 1
    for j in np.flatnonzero((end > last - count) & (out[end] == 0)):   # ... but a stream can end in a run
        nz = np.flatnonzero(out[last[j] - count[j] + 1:end[j] + 1])
        end[j] = last[j] - count[j] + (nz[-1] + 1 if nz.size else 0)
    keep = np.ones(out.size, bool)
    gone = np.repeat(end + 1, last - end) + np.arange(int((last - end).sum())) - np.repeat(
        np.cumsum(last - end) - (last - end), last - end)
    keep[gone] = False
    return out[keep].tobytes(), end - (last - count)


def _carry_through_ff(out, wrapped):
    """Bytes that wrapped from 0xFF to 0 pass the carry on to the byte before them."""
    while wrapped.size:
        wrapped = wrapped - 1
        out[wrapped] += 1
        wrapped = wrapped[out[wrapped] == 0]


def decode_streams(data: bytes, nbytes, lengths, tables, table_ids=None) -> np.ndarray:
    """Inverse of `encode_streams`: stream j's bytes are the next nbytes[j] of `data`, and it decodes
    to lengths[j] symbols. -> the symbols laid end to end (int64). A stream whose code value falls in
    no symbol's slice raises CorruptStream; every stream stops after its symbols."""
    lengths = _stream_lengths(lengths)
    _, ids, tables = _ac_inputs((), tables, table_ids, int(lengths.sum()))
    stack, nbytes = stack_tables(tables), np.asarray(nbytes, np.int64).ravel()
    if nbytes.size != lengths.size or np.any(nbytes < 0) or nbytes.sum() != len(data):
        raise ValueError("nbytes must give each stream's byte count, adding up to len(data)")
    lanes = _Lanes.of(lengths)
    # each stream followed by two zero bytes: a read position stops at the first (bytes past a
    # stream's end are zeros, as in `decode`); buf16[p] holds bytes p and p + 1
    start = np.cumsum(nbytes + 2) - (nbytes + 2)
    buf, pad = np.zeros(len(data) + 2 * len(lengths) + 1, np.uint8), np.zeros(len(data) + 2 * len(lengths), bool)
    pad[start + nbytes], pad[start + nbytes + 1] = True, True
    buf[:-1][~pad] = np.frombuffer(bytes(data), np.uint8)
    buf16 = (buf[:-1].astype(np.uint16) << 8) | buf[1:]
    start, end = start[lanes.order], (start + nbytes)[lanes.order]
    code = np.zeros(len(lengths), np.int64)
    for q in range(0, AC_STATE_BITS // 8, 2):
        code = (code << 16) | buf16[np.minimum(start + q, end)]
    pos, rng = np.minimum(start + AC_STATE_BITS // 8, end), np.full(len(lengths), 1 << AC_STATE_BITS, np.int64)
    base = lanes.to_steps(ids * (_BUCKETS + 1))
    found = np.empty(base.shape, np.uint16)
    for b, counts in lanes.blocks():
        _decode_block(code[b], rng[b], pos[b], end[b], base[:, b], found[:, b], counts, stack, buf16)
    return lanes.from_steps(found, np.int64)


def _decode_block(code, rng, pos, end, base, found, counts, stack, buf16):
    """Section 1's decoding loop, one step for every running lane at once; found[i] gets each lane's
    i-th symbol."""
    lookup = stack.lookup.view(np.int64).ravel()       # a bucket's row as one 8-byte value, for np.take
    for i, a in enumerate(counts):
        if a == 0:
            break
        code_, rng_, pos_ = code[:a], rng[:a], pos[:a]
        r = rng_ >> AC_PRECISION
        # code / r in floating point is exact where it matters: below AC_TOTAL it lies >= 1/r > 2^-33 from
        # the next integer; and a code value of AC_TOTAL or more (a corrupt stream) stays one
        v = (code_ / r).astype(np.int64)
        try:
            row = np.take(lookup, base[i, :a] + (v >> _BUCKET_SHIFT)).view(np.uint16).reshape(a, 4)
        except IndexError:                  # far beyond AC_TOTAL
            raise CorruptStream(f"step {i}: the code value lies outside every symbol's slice") from None
        s, lo, last, last2 = row.T          # symbol, its slice's start and last value, the next one's last
        second = v > last                   # v lies past the bucket's first boundary
        np.add(s, second, out=found[i, :a])
        lo = np.where(second, last + 1, lo)
        last = np.where(second, last2, last)
        j = np.flatnonzero(v > last)        # more than one boundary in the bucket, or a corrupt stream
        if j.size:
            found[i, j], lo[j], last[j] = _search(v[j], base[i, j], stack, i)
        code_ -= r * lo
        np.multiply(r, np.subtract(last, lo, dtype=np.int64) + 1, out=rng_)   # (a width can be 2^16)
        shift = np.add(rng_ < _AC_TOP, rng_ < _AC_TOP2, dtype=np.int64)    # bytes to read: 0, 1 or 2
        bits = shift << 3
        code_ <<= bits
        code_ |= np.take(buf16, pos_) >> (16 - bits)
        rng_ <<= bits
        pos_ += shift
        np.minimum(pos_, end[:a], out=pos_)


def _search(v, base, stack, step):
    """(symbol, slice start, slice's last value) of the slice that holds v, in a bucket of several
    boundaries: a binary search of the table's cdf (stack.keys). A code value at or past the table's
    total (a corrupt stream) finds the table's end, past its last symbol."""
    t = base // (_BUCKETS + 1)
    at = np.searchsorted(stack.keys, t << (AC_PRECISION + 1) | np.minimum(v, AC_TOTAL), "right") - 1
    s = at - stack.start[t]
    if np.any(s >= stack.size[t]):
        raise CorruptStream(f"step {step}: a code value lies outside every symbol's slice")
    return s, stack.cdf[at], stack.cdf[at + 1] - 1



# Exercise 3 measured: the same symbols through the serial coder, the parallel coder at several stream
# counts, and constriction's range coder (a compiled one, for scale).
THROUGHPUT_MAX_STEPS = 5_000    # the parallel coder is timed on at most this many symbols of each stream


@dataclass(frozen=True)
class CoderThroughput:
    """Symbols per second (wall clock) of each coder on the same symbols, and what streams cost."""
    symbols: int                   # symbols in all
    one_stream_bytes: int          # the serial coder's bytes for all of them as one stream
    serial_encode: float
    serial_decode: float
    streams: tuple                 # the parallel coder's stream counts ...
    parallel_encode: tuple         # ... its symbols/s at each
    parallel_decode: tuple
    added_bytes: tuple             # ... and the bytes each adds to one stream: the streams' ends and lengths
    constriction_encode: float | None = None   # None: constriction is not installed
    constriction_decode: float | None = None


def _best_time(f, repeats: int):
    best, out = math.inf, None
    for _ in range(repeats):
        t = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t)
    return best, out


def coder_throughput(symbols, table_ids, tables, stream_counts, repeats: int = 1) -> CoderThroughput:
    """symbols, table_ids (R, n): R independent rows, e.g. one per (layer, K/V, channel) of a context;
    tables: the FreqTables the ids name. The serial coder codes all R x n symbols as one stream; the
    parallel coder as k streams for each k in stream_counts (the rows in k runs, each run a stream; k
    at most R); constriction's range coder table by table. Best of `repeats`. A stream longer than
    THROUGHPUT_MAX_STEPS is timed on its first THROUGHPUT_MAX_STEPS symbols, its bytes counted from the
    serial coder's (which are the parallel coder's)."""
    syms, ids = np.asarray(symbols), np.asarray(table_ids)
    R, n = syms.shape
    flat, flat_ids, stack = syms.ravel(), ids.ravel(), stack_tables(tables)
    stack.lookup, stack.keys                             # built beforehand, as constriction's models are
    t_enc, one = _best_time(lambda: encode(flat, tables, flat_ids), repeats)
    t_dec, back = _best_time(lambda: decode(one, tables, flat.size, flat_ids), repeats)
    assert np.array_equal(back, flat), "the serial coder did not decode bit for bit"
    counts = sorted({min(int(k), R) for k in stream_counts})
    enc, dec, added = [], [], []
    for k in counts:
        lengths = np.array([len(r) * n for r in np.array_split(np.arange(R), k)])
        keep = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths) < THROUGHPUT_MAX_STEPS
        sub, sub_ids, sub_len = flat[keep], flat_ids[keep], np.minimum(lengths, THROUGHPUT_MAX_STEPS)
        te, (data, nbytes) = _best_time(lambda: encode_streams(sub, sub_len, stack, sub_ids), repeats)
        td, back = _best_time(lambda: decode_streams(data, nbytes, sub_len, stack, sub_ids), repeats)
        assert np.array_equal(back, sub), "the parallel coder did not decode bit for bit"
        if keep.all():
            sizes = nbytes.tolist()
        else:
            ends = np.cumsum(lengths).tolist()
            sizes = [len(encode(flat[e - m:e], tables, flat_ids[e - m:e])) for e, m in zip(ends, lengths.tolist())]
        enc.append(sub.size / te)
        dec.append(sub.size / td)
        added.append(sum(sizes) + sum(len(_varint(b)) for b in sizes[:-1]) - len(one))
    c_enc, c_dec = _constriction_throughput(flat, flat_ids, tables, repeats)
    return CoderThroughput(int(flat.size), len(one), flat.size / t_enc, flat.size / t_dec, tuple(counts),
                           tuple(enc), tuple(dec), tuple(added), c_enc, c_dec)


def _constriction_throughput(syms, ids, tables, repeats: int):
    """constriction's range coder on the same symbols, table by table (one call per table, its model
    built beforehand, as our tables are) -> (encode, decode) symbols/s, or (None, None)."""
    try:
        import constriction
    except ImportError:
        return None, None
    order = np.argsort(ids, kind="stable")
    cuts = np.flatnonzero(np.diff(ids[order])) + 1
    runs = np.split(syms[order].astype(np.int32), cuts)
    models = [constriction.stream.model.Categorical(tables[t].probs(), perfect=False)
              for t in ids[order][np.r_[0, cuts]].tolist()] if syms.size else []

    def enc():
        coder = constriction.stream.queue.RangeEncoder()
        for run, model in zip(runs, models):
            coder.encode(run, model)
        return coder.get_compressed()

    te, data = _best_time(enc, repeats)

    def dec():
        coder = constriction.stream.queue.RangeDecoder(data)
        return [coder.decode(model, len(run)) for run, model in zip(runs, models)]

    td, back = _best_time(dec, repeats)
    assert all(np.array_equal(a, b) for a, b in zip(back, runs)), "constriction did not decode bit for bit"
    return syms.size / te, syms.size / td

# ========================================================================= 3. CacheGen-style codec
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
STREAM_LAYOUTS = ("group", "K/V", "layer", "channel")   # one stream per group, per K/V of a group, per
                                                        # (layer, K/V) or per (layer, K/V, channel) of a group
STREAM_BUDGET = 0.005      # a group is cut into more streams only while they add at most 0.5% to its bytes
STREAM_END_BYTES = 1 / 3   # a stream's end costs about a third of a byte over its ideal length (test_coder)
PARALLEL_MIN_STREAMS = 256  # fewer streams side by side: the serial coder is faster (it makes the same bytes)


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
    spec = CodecSpec(steps, bool(delta), anchor_scale.astype(np.float32),
                     np.full((L, 2), CODEC_MAX_RADIUS), (), int(level), int(group))
    q = quantize(calib, spec)
    free = q if not delta else q[..., ~_anchor_mask(q.shape[-4], group), :, :, :]
    seen = np.abs(free).max(axis=tuple(range(free.ndim - 3)) + (free.ndim - 1,)) if free.size else np.zeros((L, 2))
    spec = replace(spec, radius=np.minimum(CODEC_MAX_RADIUS, np.ceil(seen * 1.25) + 2).astype(np.int64))
    syms, ids = _symbols(q, spec)  # the radius covers every value seen, so q is unchanged by it
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
    for rows, n, cdfs in _cdfs_by_size(unseen_uniform(counts), sizes):
        bits -= float((counts[rows, :n] * np.log2(np.diff(cdfs, axis=1) / AC_TOTAL)).sum())
    return bits


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _read_varints(data: bytes, pos: int, count: int, what: str):
    """count varints from data[pos:] -> (values, position after them)."""
    out = []
    for _ in range(count):
        n = shift = 0
        while True:
            if pos >= len(data) or shift > 28:
                raise CorruptStream(f"truncated {what}")
            b = data[pos]
            pos += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        out.append(n)
    return out, pos


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
    st = spec.stack
    inner = np.ones(st.cdf.size - 1, bool)
    inner[(st.start + st.size)[:-1]] = False                    # entries that cross into the next table
    p = np.diff(st.cdf) / AC_TOTAL
    h = np.where(inner & (p > 0), -p * np.log2(np.where(p > 0, p, 1)), 0)
    table_bits = np.bincount(np.repeat(np.arange(len(st.size)), st.size + 1)[:-1], h, len(st.size))
    n_value = table_bits.size // 2 if spec.delta else table_bits.size
    group_bits = table_bits[:n_value].sum() * (spec.group - spec.delta) + table_bits[n_value:].sum()
    out = []
    for layout, S in _layout_streams(spec).items():
        length_bytes = len(_varint(int(group_bits / 8 / S)))
        out.append(StreamPlan(layout, S, group_bits / 8, (S - 1) * (STREAM_END_BYTES + length_bytes)))
    return out


def stream_plan(spec: CodecSpec, tokens: int) -> StreamPlan:
    """The layout the codec uses for a context of `tokens` tokens: the one with the most streams whose
    expected added bytes stay within STREAM_BUDGET of a group's payload; but one stream per group when
    even those would leave the context fewer than PARALLEL_MIN_STREAMS streams (the serial coder codes
    it then, and more streams would only add bytes)."""
    plans = stream_plans(spec)
    best = [p for p in plans if p.streams == 1 or p.added_share <= STREAM_BUDGET][-1]
    return best if coder_for(best.streams * -(-tokens // spec.group)) == "parallel" else plans[0]


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
    syms, ids = _symbols(quantize(X, spec), spec)
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
            payloads.append(b"".join(_varint(int(n)) for n in nbytes[j:j + S - 1])
                            + data[ends[j] - nbytes[j]:ends[j + S - 1]])
        out.append(header + b"".join(_varint(len(p)) for p in payloads) + b"".join(payloads))
    return out


def codec_encode(X, spec: CodecSpec, layout: str | None = None) -> bytes:
    """One context's KV (T, L, 2, C) -> its bitstream (codec_encode_many)."""
    X = np.asarray(X, np.float32)
    if X.ndim != 4:
        raise ValueError(f"need KV of shape (T, {', '.join(map(str, spec.shape))}) with 0 < T < 65536")
    return codec_encode_many(X[None], spec, layout)[0]


def codec_header(data: bytes) -> dict:
    """Parse the header and the group lengths: what a decoder learns from the bitstream alone."""
    if len(data) < _CODEC_HEADER.size:
        raise CorruptStream("shorter than a codec header")
    magic, version, level, flags, group, T, fp = _CODEC_HEADER.unpack_from(data)
    if (magic != CODEC_MAGIC or version != CODEC_VERSION or flags >> 1 >= len(STREAM_LAYOUTS) or group == 0
            or T == 0):
        raise CorruptStream("not a codec bitstream of this version")
    lengths, pos = _read_varints(data, _CODEC_HEADER.size, -(-T // group), "group lengths")
    if pos + sum(lengths) != len(data):
        raise CorruptStream(f"payload is {len(data) - pos} bytes, the header announces {sum(lengths)}")
    return {"level": level, "delta": bool(flags & 1), "layout": STREAM_LAYOUTS[flags >> 1], "group": group,
            "tokens": T, "fingerprint": fp, "group_bytes": lengths, "payload_start": pos}


def codec_decode_many(datas, specs, groups=None) -> list:
    """Bitstreams -> the quantized integers (T, L, 2, C) of each, exactly as `quantize` made them.
    `specs`: one CodecSpec or several (e.g. every level of a model); each header's fingerprint picks
    the one its data was coded with. `groups`: decode only these groups (the other rows stay 0).
    The streams of every bitstream coded with one spec are decoded side by side."""
    specs = [specs] if isinstance(specs, CodecSpec) else list(specs)
    out, jobs = [], {}                               # spec fingerprint -> (spec, streams to decode)
    for data in datas:
        h = codec_header(data)
        spec = next((s for s in specs if s.fingerprint == h["fingerprint"]), None)
        if spec is None:
            raise ValueError(f"no codec spec with fingerprint {h['fingerprint']:08x} (another model or level)")
        q = np.zeros((h["tokens"], *spec.shape), np.int64)
        out.append(q)
        jobs.setdefault(spec.fingerprint, (spec, []))[1].extend(_group_streams(data, h, spec, q, groups))
    for spec, job in jobs.values():
        if job:
            _decode_job(spec, job)
    return [q.astype(np.int32) for q in out]


def _group_streams(data: bytes, h: dict, spec: CodecSpec, q, groups):
    """The streams of each group to decode: (q's values, where they go, their tables, their symbol
    counts, their byte counts, their bytes)."""
    order, lengths, S = _stream_order(h["tokens"], spec, h["layout"])
    _, ids = _symbols(q, spec)
    flat, ids = q.reshape(-1), ids.reshape(-1)
    start, first = np.cumsum([h["payload_start"]] + h["group_bytes"]), np.cumsum(np.r_[0, lengths])
    out = []
    for g in range(len(h["group_bytes"])) if groups is None else groups:
        counts, pos = _read_varints(data, start[g], S - 1, "stream lengths")
        counts.append(start[g + 1] - pos - sum(counts))
        if counts[-1] < 0:
            raise CorruptStream(f"group {g}: its streams are longer than the group")
        where = order[first[g * S]:first[(g + 1) * S]]
        out.append((flat, where, ids[where], lengths[g * S:(g + 1) * S], counts, data[pos:start[g + 1]]))
    return out


def _decode_job(spec: CodecSpec, job):
    """Decode the streams of several groups (of one or more bitstreams) at once, into their arrays."""
    ids = np.concatenate([j[2] for j in job])
    syms = _decode_any(b"".join(j[5] for j in job), np.concatenate([j[4] for j in job]),
                       np.concatenate([j[3] for j in job]), spec, ids)
    L, _, C = spec.shape
    offset = np.concatenate([np.repeat(np.asarray(spec.radius).ravel(), C), np.full(L * 2 * C, ANCHOR_MAX)])
    values, at = syms - offset[ids], 0
    for flat, where, *_ in job:
        flat[where] = values[at:at + where.size]
        at += where.size


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
    syms, ids = _symbols(quantize(X, spec), spec)
    return ideal_bits(syms.ravel(), list(spec.tables), ids.ravel())


def spec_to_dict(spec: CodecSpec) -> dict:
    return {"steps": spec.steps.tolist(), "delta": spec.delta, "anchor_scale": spec.anchor_scale.tolist(),
            "radius": spec.radius.tolist(), "tables": [list(t.cdf) for t in spec.tables],
            "level": spec.level, "group": spec.group}


def spec_from_dict(d: dict) -> CodecSpec:
    return CodecSpec(np.array(d["steps"], np.float32), bool(d["delta"]), np.array(d["anchor_scale"], np.float32),
                     np.array(d["radius"], np.int64), tuple(FreqTable(tuple(c)) for c in d["tables"]),
                     int(d["level"]), int(d["group"]))


# ====================================================================== 4. Levels and the recipe
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

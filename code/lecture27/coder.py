"""CacheGen's arithmetic coder (handout §3.3): a static-table integer arithmetic coder. It keeps an
interval and narrows it, symbol by symbol, to the slice the symbol owns (its width is the symbol's
probability), so a symbol of probability p costs -log2 p bits and a stream comes close to its entropy;
it is lossless (the codec loses only where it quantizes). Tables are made once from counts (CacheGen
fits one per channel and layer, offline, shared by encoder and decoder); exercise 4 measures the coder
against the entropy of a distribution. numpy only (constriction's throughput, for scale, is timed by
common/clock.py, the one timer). The same coder on thousands of streams at once is
coder_parallel.py's; the codec built on it is kvcache.py's.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import numpy as np

from common.clock import fastest

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
#   constriction_throughput(symbols, ids, tables)   a compiled range coder's symbols/s on them, for scale
# The bytes are the bare code value: the decoder must be given n, the tables and the table ids.
AC_PRECISION = 16       # a table's frequencies sum to 2^16: the rarest symbol has p = 2^-16
AC_TOTAL = 1 << AC_PRECISION
AC_STATE_BITS = 48      # rng stays in [2^40, 2^48], so `rng >> AC_PRECISION` loses < 2^-24 of
AC_SHIFT = AC_STATE_BITS - 8   # the interval per symbol (< 1e-7 bits)
AC_TOP, AC_MASK, _AC_FF = 1 << AC_SHIFT, (1 << AC_STATE_BITS) - 1, 0xFF << AC_SHIFT


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
    for rows, _, cdfs in cdfs_by_size(np.asarray(counts, np.float64), np.asarray(sizes)):
        for j, cdf in zip(rows, cdfs.tolist()):
            out[j] = FreqTable(tuple(cdf))
    return tuple(out)


def cdfs_by_size(counts, sizes):
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


def coder_inputs(symbols, tables, table_ids, n: int | None = None, sizes=None):
    """`tables` is one FreqTable for every symbol, or a list of FreqTables (or the parallel coder's tables
    as arrays, with their alphabet `sizes`) with `table_ids[i]` naming the table of symbol i.
    -> (symbols, table ids, list of tables) as arrays, validated. A decoder passes no symbols and their
    number n."""
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
    sizes = np.array([t.size for t in tables]) if sizes is None else sizes
    if syms.size and (syms.dtype.kind not in "iu" or syms.min() < 0 or np.any(syms >= sizes[ids])):
        raise ValueError("symbols must be integers within their table's alphabet")
    return syms, ids, tables


def _shift_low(low, cache, pending, out):
    """Shift the top byte of `low` out of the window (held back until no carry can reach it)."""
    if low < _AC_FF or low > AC_MASK:             # top byte below 0xFF, or a carry just came
        carry = low >> AC_STATE_BITS
        out.append(cache + carry)
        out.extend(((0xFF + carry) & 0xFF,) * pending)
        cache, pending = (low >> AC_SHIFT) & 0xFF, 0
    else:                                         # top byte 0xFF: a carry could still flip it
        pending += 1
    return (low << 8) & AC_MASK, cache, pending


def encode(symbols, tables, table_ids=None) -> bytes:
    """Code integer symbols with one table, or with per-symbol tables (tables[table_ids[i]]).
    The bytes hold only the code value: decoding needs n and the same tables and ids."""
    syms, ids, tables = coder_inputs(symbols, tables, table_ids)
    cdfs, out = [t.cdf for t in tables], bytearray()
    low, rng, cache, pending = 0, 1 << AC_STATE_BITS, 0, 0
    for s, t in zip(syms.tolist(), ids.tolist()):
        cdf = cdfs[t]
        r = rng >> AC_PRECISION
        low += r * cdf[s]                         # move to the symbol's slice ...
        rng = r * (cdf[s + 1] - cdf[s])           # ... of width rng * p
        if rng <= 0:                              # nothing can narrow to an empty slice
            raise ValueError(f"symbol {s} has a slice of zero width in its table")
        while rng < AC_TOP:
            low, cache, pending = _shift_low(low, cache, pending, out)
            rng <<= 8
    # finish with the value in [low, low + rng) that has the most trailing zero bits (rng >= 2^40
    # guarantees a multiple of 2^40); the decoder reads bytes past the end as zeros, so strip them
    for b in range(AC_STATE_BITS, AC_SHIFT - 1, -1):
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
    _, ids, tables = coder_inputs((), tables, table_ids, n)
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
        while rng < AC_TOP:
            code = (code << 8) | (buf[pos] if pos < end else 0)
            pos += 1
            rng <<= 8
        out[i] = s
    return np.array(out, dtype=np.int64)


def ideal_bits(symbols, tables, table_ids=None) -> float:
    """The ideal code length -sum log2 p(symbol) under the quantized tables, in bits (vectorized: every
    table's CDF laid end to end, each symbol's frequency read as cdf[s + 1] - cdf[s] of its table)."""
    syms, ids, tables = coder_inputs(symbols, tables, table_ids)
    cdf, start, _ = laid_end_to_end(tables)
    at = start[ids] + syms.astype(np.int64)
    return float(-np.log2((cdf[at + 1] - cdf[at]) / AC_TOTAL).sum()) if syms.size else 0.0


def laid_end_to_end(tables):
    """A FreqTable or a sequence of them -> (every table's CDF laid end to end (int64), where each table's
    starts, each table's size): table t's cdf is cdf[start[t] : start[t] + size[t] + 1]."""
    tables = [tables] if isinstance(tables, FreqTable) else tables
    size = np.array([len(t.cdf) - 1 for t in tables], np.int64)
    cdf = np.fromiter(itertools.chain.from_iterable(t.cdf for t in tables), np.int64, int((size + 1).sum()))
    return cdf, np.cumsum(size + 1) - (size + 1), size


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


def constriction_throughput(syms, ids, tables, repeats: int = 1):
    """constriction's range coder (a compiled one, for scale) on these symbols, table by table (one call
    per table, its model built beforehand, as our tables are); best of `repeats`. -> (encode, decode)
    symbols/s, or (None, None) where constriction is not installed."""
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

    data, te = fastest(enc, repeats)

    def dec():
        coder = constriction.stream.queue.RangeDecoder(data)
        return [coder.decode(model, len(run)) for run, model in zip(runs, models)]

    back, td = fastest(dec, repeats)
    assert all(np.array_equal(a, b) for a, b in zip(back, runs)), "constriction did not decode bit for bit"
    return syms.size / te, syms.size / td

"""CacheGen's arithmetic coder on many streams at once, as a GPU runs them (handout §3.3, exercise 3):
every token of a group refers to the same anchor, so a context's groups, and each (layer, K/V,
channel) of a group, are independent streams, coded side by side. numpy only. The coder itself is
coder.py's; how the codec cuts a context into streams, and when it takes this coder, kvcache.py's; how
fast each coder runs, coder_bench.py's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from lecture27.coder import (AC_MASK, AC_PRECISION, AC_SHIFT, AC_STATE_BITS, AC_TOP, AC_TOTAL, CorruptStream,
                   coder_inputs, laid_end_to_end)

# CacheGen's GPU coder runs one stream per (layer, channel), thousands of them side by side. This is
# coder.py's coder written for arrays: many independent streams advance one symbol per step together,
# each stream a lane of numpy arrays (low and rng when encoding; code, rng and a read position when
# decoding). Each stream's bytes are exactly what coder.encode makes of that stream alone. A step costs a
# few dozen numpy operations whatever the number of lanes, so the coder is fast only with many streams;
# and each stream ends with its own flush, so many short streams cost bytes.
#   stack = stack_tables(tables)            tables as arrays (build once per set of tables, reuse)
#   data, nbytes = encode_streams(symbols, lengths, stack, table_ids)
#                                           streams laid end to end (lengths[j] symbols each) -> their
#                                           bytes laid end to end and each stream's byte count
#   syms = decode_streams(data, nbytes, lengths, stack, table_ids)
#   syms = decode_lanes(data, nbytes, table_ids, stack)
#                                           streams of equal length as the columns of a (steps, lanes)
#                                           matrix: no laying end to end and back (the codec's channel layout)
# The encoder's one sequential detail, the carry, is settled after the loop: each step records low as
# it was before its shifts, carry bit included, and the carries of all streams are then added to the
# bytes before them at once. The decoder finds a symbol in a lookup of 256 buckets per table (the
# symbol where each bucket starts, its slice and the next one) and searches the table's cdf only where
# a bucket holds more boundaries (the rare symbols: about 1% of SmolLM2's).
_BUCKET_SHIFT = 8                         # a bucket is 2^8 of the AC_TOTAL code values
_BUCKETS = AC_TOTAL >> _BUCKET_SHIFT      # + 1 more, for a code value of AC_TOTAL (a corrupt stream)
_AC_TOP2 = 1 << (AC_SHIFT - 8)            # rng below this: two bytes to shift (rng >= 2^24 after a symbol)
_LOOKUP_MAX_SIZE = 1 << 12                # the parallel decoder's tables: at most 4096 symbols
PARALLEL_BLOCK = 65536                    # lanes coded together: a step's numpy calls (and the decoder's search
                                          # for rare symbols) cost about the same for few lanes as for many; 2^16
                                          # lanes share them, decoding SmolLM2's KV 15% faster than 2^14 here,
                                          # while a step's arrays stay a few MB
_LENGTH_RUNS = 8                          # streams of at most this many lengths are decoded one length at a time


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
    return tables if isinstance(tables, TableStack) else TableStack(*laid_end_to_end(tables))


def _inputs(symbols, tables, table_ids, n: int | None = None):
    """coder.coder_inputs, the tables given as FreqTables or as a TableStack."""
    return coder_inputs(symbols, tables, table_ids, n, tables.size if isinstance(tables, TableStack) else None)


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


def _blocks(lanes: int, active: list):
    """(lane slice, running lanes at each step within it) of each block of PARALLEL_BLOCK lanes, where active[i]
    lanes (the first ones) run at step i."""
    for b in range(0, lanes, PARALLEL_BLOCK):
        e = min(lanes, b + PARALLEL_BLOCK)
        yield slice(b, e), [min(max(a - b, 0), e - b) for a in active]


def _stream_lengths(lengths, total: int | None = None) -> np.ndarray:
    lengths = np.asarray(lengths).ravel()
    if lengths.dtype.kind not in "iu" or np.any(lengths < 0) or total not in (None, lengths.sum()):
        raise ValueError("lengths must be non-negative integers that add up to the number of symbols")
    return lengths.astype(np.int64)


def encode_streams(symbols, lengths, tables, table_ids=None):
    """Code the streams laid end to end in `symbols` (stream j: the next lengths[j] symbols), all at
    once. -> (their bytes laid end to end, each stream's byte count): stream j's bytes are
    coder.encode(its symbols, tables, its table ids)."""
    syms, ids, tables = _inputs(symbols, tables, table_ids)
    lengths, stack = _stream_lengths(lengths, syms.size), stack_tables(tables)
    at = stack.start[ids] + syms
    lo, width = stack.cdf32[at], stack.width32[at]
    if stack.empty_slices and np.any(width <= 0):
        raise ValueError(f"symbol {syms[np.argmax(width <= 0)]} has a slice of zero width in its table")
    lanes = _Lanes.of(lengths)
    LO, W = lanes.to_steps(lo), lanes.to_steps(width)
    tops, shifts = np.zeros(LO.shape, np.int32), np.zeros(LO.shape, np.int8)
    low, rng = np.zeros(len(lengths), np.int64), np.full(len(lengths), 1 << AC_STATE_BITS, np.int64)
    for b, counts in _blocks(len(lengths), lanes.active):
        _encode_block(low[b], rng[b], LO[:, b], W[:, b], tops[:, b], shifts[:, b], counts)
    return _settle(tops, shifts, _final_value(low, rng), lanes.order)


def _encode_block(low, rng, LO, W, tops, shifts, counts):
    """coder.encode's loop, one step for every running lane at once. Each step records the top
    17 bits of low before its shifts (0, 1 or 2 bytes): the carry bit that coder.encode would pass on to
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
        np.right_shift(low_, AC_SHIFT - 8, out=tops[i, :a], casting="unsafe")
        low_ <<= bits
        low_ &= AC_MASK
        rng_ <<= bits


def _shift_bits(rng) -> np.ndarray:
    """Bits to shift after a symbol (int64): 16 below 2^32, 8 below 2^40, else 0."""
    bits = (rng < AC_TOP) * 8
    bits += (rng < _AC_TOP2) * 8
    return bits


def _final_value(low, rng) -> np.ndarray:
    """Each lane's final value, as coder.encode picks it: the number in [low, low + rng) with the most
    trailing zero bits, of at least 2^40 and at most 2^48: the multiple of 2^b at or above low, where
    bit b is the highest in which low - 1 and low + rng - 1 differ (frexp gives the bit length)."""
    differ = np.where(low > 0, (low - 1) ^ (low + rng - 1), 1 << 60)
    b = np.clip(np.frexp(differ.astype(np.float64))[1] - 1, AC_SHIFT, AC_STATE_BITS)
    return -(-low >> b) << b


def _settle(tops, shifts, final, order):
    """Each lane's bytes: each step's shifted bytes, then the final value's top byte; every carry
    added to the byte before its step (and on through a run of 0xFF: between two shifts low can
    carry only once, so a byte gets at most one); trailing zeros stripped as coder.encode does.
    -> (bytes of the lanes in stream order, laid end to end; counts)."""
    S, n = len(order), tops.shape[0]
    lane = np.empty_like(order)
    lane[order] = np.arange(S)
    if np.any(lane != np.arange(S)):                           # lanes back in stream order
        tops, shifts, final = tops[:, lane], shifts[:, lane], final[lane]
    top, k = tops.T, shifts.T                                 # (lanes, steps)
    slots, taken = np.zeros((S, n + 1, 2), np.uint8), np.zeros((S, n + 1, 2), bool)
    slots[:, :n, 0], slots[:, :n, 1], slots[:, n, 0] = top >> 8, top, final >> AC_SHIFT   # bytes (mod 256)
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
    _, ids, tables = _inputs((), tables, table_ids, int(lengths.sum()))
    stack, nbytes = stack_tables(tables), np.asarray(nbytes, np.int64).ravel()
    if nbytes.size != lengths.size or np.any(nbytes < 0) or nbytes.sum() != len(data):
        raise ValueError("nbytes must give each stream's byte count, adding up to len(data)")
    buf16, start, end = _padded(data, nbytes)
    runs = np.unique(lengths) if lengths.size <= PARALLEL_BLOCK else np.flatnonzero(np.bincount(lengths))
    if runs.size > _LENGTH_RUNS:     # lanes longest first, the streams still running at step i first
        lanes = _Lanes.of(lengths)
        found = _decode_lanes(start[lanes.order], end[lanes.order], lanes.to_steps(ids * (_BUCKETS + 1)),
                              lanes.active, stack, buf16)
        return lanes.from_steps(found, np.int64)
    # streams of one length at a time: each run of steps holds only lanes that are all still running, and
    # a short stream (a 3-token context's) makes no longer one wait, nor the other way round
    out = np.empty(ids.size, np.int64)
    for n in runs[runs > 0].tolist():
        mine = lengths == n
        j = np.flatnonzero(mine)
        at = slice(None) if j.size == lengths.size else np.repeat(mine, lengths)
        base = np.ascontiguousarray((ids[at] * (_BUCKETS + 1)).reshape(j.size, n).T)
        out[at] = _decode_lanes(start[j], end[j], base, [j.size] * n, stack, buf16).T.ravel()
    return out


def decode_lanes(data: bytes, nbytes, table_ids, tables) -> np.ndarray:
    """Streams of equal length given as a matrix: table_ids (steps, P) holds the table of lane j's i-th
    symbol in column j % P (P: every lane, or fewer columns repeated across the lanes: several groups of the
    channel layout side by side share one table per (layer, K/V, channel)); lane j's bytes are the j-th
    nbytes of `data`. -> the symbols, (steps, lanes) uint16: what decode_streams gives, without laying the
    streams end to end first (a layout whose streams are the columns of the context's values reads them in
    place)."""
    table_ids = np.asarray(table_ids)
    stack, nbytes = stack_tables(tables), np.asarray(nbytes, np.int64).ravel()
    if (table_ids.ndim != 2 or not table_ids.shape[1] or nbytes.size % table_ids.shape[1] or np.any(nbytes < 0)
            or nbytes.sum() != len(data)):
        raise ValueError("need (steps, lanes) table ids and each lane's byte count, adding up to len(data)")
    if table_ids.size and (table_ids.min() < 0 or table_ids.max() >= len(stack)):
        raise ValueError("a table id names no table")
    buf16, start, end = _padded(data, nbytes)
    return _decode_lanes(start, end, table_ids * (_BUCKETS + 1), [nbytes.size] * table_ids.shape[0], stack, buf16)


def _padded(data, nbytes):
    """Each stream's bytes followed by two zero bytes: a read position stops at the first (bytes past a
    stream's end are zeros, as in coder.decode). -> (buf16: buf16[p] holds bytes p and p + 1, where each
    stream's bytes start, where they end)."""
    start = np.cumsum(nbytes + 2) - (nbytes + 2)
    buf, pad = np.zeros(len(data) + 2 * len(nbytes) + 1, np.uint8), np.zeros(len(data) + 2 * len(nbytes), bool)
    pad[start + nbytes], pad[start + nbytes + 1] = True, True
    buf[:-1][~pad] = np.frombuffer(data, np.uint8) if len(data) else 0
    return (buf[:-1].astype(np.uint16) << 8) | buf[1:], start, start + nbytes


def _decode_lanes(start, end, base, active, stack, buf16) -> np.ndarray:
    """Lanes whose bytes lie in buf16 from start to end, decoded in blocks of PARALLEL_BLOCK lanes: base
    (steps, P) holds the first lookup row of the table of lane j's symbols in column j % P; active[i] lanes
    run at step i (the first ones). -> the symbols, (steps, lanes) uint16."""
    S, P = len(start), base.shape[1]
    found = np.empty((base.shape[0], S), np.uint16)
    for at, counts in _blocks(S, active):
        first, last = start[at], end[at]
        code = np.zeros(len(first), np.int64)
        for q in range(0, AC_STATE_BITS // 8, 2):          # the code value: a stream's first six bytes
            code = (code << 16) | buf16[np.minimum(first + q, last)]
        pos, rng = np.minimum(first + AC_STATE_BITS // 8, last), np.full(len(first), 1 << AC_STATE_BITS, np.int64)
        tables = base[:, at] if P == S else base[:, np.arange(at.start, at.stop) % P]
        _decode_block(code, rng, pos, last, tables, found[:, at], counts, stack, buf16)
    return found


def _decode_block(code, rng, pos, end, base, found, counts, stack, buf16):
    """coder.decode's loop, one step for every running lane at once; found[i] gets each lane's
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
        shift = np.add(rng_ < AC_TOP, rng_ < _AC_TOP2, dtype=np.int64)    # bytes to read: 0, 1 or 2
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





# Streams laid end to end in one bitstream are told apart by their byte counts, each written as a varint:
# 7 bits a byte, low bits first, the top bit set on every byte but the last.
def varint(n: int) -> bytes:
    """n >= 0 as a varint."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def read_varints(data: bytes, pos: int, count: int, what: str):
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


def read_varint_runs(buf: np.ndarray, starts, count: int, what: str):
    """read_varints at many places at once: `count` varints from each of `starts` in buf (uint8).
    -> (values (len(starts), count) int64, the position after each run). A varint ends at its first
    byte below 0x80: the runs are read from where those bytes lie, without a Python loop per varint."""
    starts = np.asarray(starts, np.int64)
    if count == 0 or starts.size == 0:
        return np.zeros((starts.size, count), np.int64), starts.copy()
    if starts.max() + count <= buf.size:       # lengths below 128 (the channel layout's): one byte each
        short = buf[starts[:, None] + np.arange(count)]
        if np.all(short < 0x80):
            return short.astype(np.int64), starts + count
    ends = np.flatnonzero(buf < 0x80)                            # the last byte of every varint there could be
    first = np.searchsorted(ends, starts)
    if np.any(first + count > ends.size):
        raise CorruptStream(f"truncated {what}")
    last = ends[first[:, None] + np.arange(count)]               # (runs, count): each varint's last byte
    begin = np.concatenate([starts[:, None], last[:, :-1] + 1], axis=1)
    n = last - begin + 1
    if np.any(n > 5):                                           # 5 bytes hold 35 bits: more is not a length
        raise CorruptStream(f"truncated {what}")
    values = (buf[last] & 0x7F).astype(np.int64) << (7 * (n - 1))
    for j in range(4):                                           # the bytes before the last, low bits first
        more = n > j + 1
        values |= np.where(more, (buf[np.where(more, begin + j, 0)] & 0x7F).astype(np.int64) << (7 * j), 0)
    return values, last[:, -1] + 1

"""Exercise 3 measured: how fast CacheGen's coder runs on one context's symbols (handout §3.3). The same
symbols through the serial coder as one stream, through the parallel coder at several stream counts
(the streams a GPU would run side by side) and through constriction's range coder (a compiled one, for
scale); symbols per second, and the bytes the extra streams add. The coders are coder.py's and
coder_parallel.py's; 02 prints the table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.clock import fastest
from lecture27.coder import constriction_throughput, decode, encode
from lecture27.coder_parallel import decode_streams, encode_streams, stack_tables, varint

THROUGHPUT_MAX_STEPS = 5_000    # the parallel coder is timed on at most this many symbols of each stream


@dataclass(frozen=True, kw_only=True)
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
    one, t_enc = fastest(lambda: encode(flat, tables, flat_ids), repeats)
    back, t_dec = fastest(lambda: decode(one, tables, flat.size, flat_ids), repeats)
    assert np.array_equal(back, flat), "the serial coder did not decode bit for bit"
    counts = sorted({min(int(k), R) for k in stream_counts})
    enc, dec, added = [], [], []
    for k in counts:
        lengths = np.array([len(r) * n for r in np.array_split(np.arange(R), k)])
        keep = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths) < THROUGHPUT_MAX_STEPS
        sub, sub_ids, sub_len = flat[keep], flat_ids[keep], np.minimum(lengths, THROUGHPUT_MAX_STEPS)
        (data, nbytes), te = fastest(lambda: encode_streams(sub, sub_len, stack, sub_ids), repeats)
        back, td = fastest(lambda: decode_streams(data, nbytes, sub_len, stack, sub_ids), repeats)
        assert np.array_equal(back, sub), "the parallel coder did not decode bit for bit"
        if keep.all():
            sizes = nbytes.tolist()
        else:
            ends = np.cumsum(lengths).tolist()
            sizes = [len(encode(flat[e - m:e], tables, flat_ids[e - m:e])) for e, m in zip(ends, lengths.tolist())]
        enc.append(sub.size / te)
        dec.append(sub.size / td)
        added.append(sum(sizes) + sum(len(varint(b)) for b in sizes[:-1]) - len(one))
    c_enc, c_dec = constriction_throughput(flat, flat_ids, tables, repeats)
    return CoderThroughput(symbols=int(flat.size), one_stream_bytes=len(one), serial_encode=flat.size / t_enc,
                           serial_decode=flat.size / t_dec, streams=tuple(counts), parallel_encode=tuple(enc),
                           parallel_decode=tuple(dec), added_bytes=tuple(added), constriction_encode=c_enc,
                           constriction_decode=c_dec)

"""The parallel coder of coder_parallel.py: many streams coded side by side, each stream's bytes
exactly those of the serial coder (coder.py) on that stream alone; decoding back bit for bit; damaged
input and tables with empty slices end in an error, never in a loop; and the codec's stream layouts
(kvcache.py): every layout round-trips, groups still decode alone, the plan's expected cost holds."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as hs

from lecture27 import coder as ac
from lecture27.codec import coder_bench as bench
from lecture27 import coder_parallel as acp
from lecture27 import kvcache as kv
from test_coder import _table_and_symbols, carry_case, within


def _streams(seed, n_streams, max_len, n_tables, uniform_symbols):
    """Random tables (their smallest entries at the coder's minimum), stream lengths from 0 to max_len,
    and per-symbol tables and symbols."""
    rng = np.random.default_rng(seed)
    tables = [_table_and_symbols(seed + j, int(rng.integers(1, 300)), 0, [0.05, 0.3, 3.0][j % 3], False)[0]
              for j in range(n_tables)]
    lengths = rng.integers(0, max_len + 1, n_streams)
    ids = rng.integers(n_tables, size=lengths.sum())
    sizes = np.array([t.size for t in tables])
    if uniform_symbols:
        syms = (rng.random(ids.size) * sizes[ids]).astype(np.int64)
    else:  # each table's own distribution: the inverse CDF of a uniform code value
        stack = acp.stack_tables(tables)
        u = rng.integers(0, ac.AC_TOTAL, ids.size)
        syms = np.array([np.searchsorted(tables[t].cdf, x, "right") - 1 for t, x in zip(ids.tolist(), u.tolist())],
                        np.int64).reshape(-1)
        assert np.all(syms < stack.size[ids])
    return tables, lengths, ids, syms


def _each_stream(lengths, *arrays):
    ends = np.cumsum(lengths)
    for e, n in zip(ends.tolist(), lengths.tolist()):
        yield tuple(a[e - n:e] for a in arrays)


def _assert_equals_serial(tables, lengths, ids, syms):
    data, nbytes = acp.encode_streams(syms, lengths, tables, ids)
    assert nbytes.sum() == len(data) and len(nbytes) == len(lengths)
    parts = [data[e - n:e] for e, n in zip(np.cumsum(nbytes).tolist(), nbytes.tolist())]
    for part, (s, i) in zip(parts, _each_stream(lengths, syms, ids)):
        assert part == ac.encode(s, tables, i)                      # the serial coder's bytes, exactly
    back = acp.decode_streams(data, nbytes, lengths, tables, ids)
    assert back.dtype == np.int64 and np.array_equal(back, syms)
    return data, nbytes


# ------------------------------------------------------------------------------ equal to serial
@settings(max_examples=40, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), n_streams=hs.integers(1, 60), max_len=hs.sampled_from([0, 3, 40, 700]),
       n_tables=hs.integers(1, 12), uniform_symbols=hs.booleans())
def test_each_stream_is_the_serial_coders_bytes(seed, n_streams, max_len, n_tables, uniform_symbols):
    _assert_equals_serial(*_streams(seed, n_streams, max_len, n_tables, uniform_symbols))


@pytest.mark.slow
def test_thousands_of_short_streams_in_blocks():
    """More streams than one block of lanes (acp.PARALLEL_BLOCK), of different lengths: they decode to their
    symbols, and every 101st stream's bytes are the serial coder's."""
    tables, lengths, ids, syms = _streams(5, 2 * acp.PARALLEL_BLOCK + 17, 6, 30, False)
    data, nbytes = acp.encode_streams(syms, lengths, tables, ids)
    assert np.array_equal(acp.decode_streams(data, nbytes, lengths, tables, ids), syms)
    ends, bends = np.cumsum(lengths), np.cumsum(nbytes)
    for j in range(0, len(lengths), 101):
        a, b = ends[j] - lengths[j], bends[j] - nbytes[j]
        assert data[b:bends[j]] == ac.encode(syms[a:ends[j]], tables, ids[a:ends[j]])


@pytest.mark.parametrize("case", ["top", "bottom", "alternate"])
def test_long_carry_runs_side_by_side(case):
    """Runs of 0xFF bytes that a late carry must flip, and streams of all-zero bytes (stripped), in
    streams of different lengths coded together."""
    n = 30_000
    table, syms = carry_case(case, n)
    lengths = np.array([n // 2, 1, 0, n // 4, n - n // 2 - n // 4 - 1])
    _assert_equals_serial([table], lengths, np.zeros(n, np.int64), syms)


def test_empty_and_single_symbol_streams():
    one, two = ac.make_table([5]), ac.make_table([1, 3])
    data, nbytes = acp.encode_streams(np.zeros(7, np.int64), [3, 0, 4], [one, two], np.zeros(7, np.int64))
    assert data == b"" and nbytes.tolist() == [0, 0, 0]
    assert np.array_equal(acp.decode_streams(b"", [0, 0, 0], [3, 0, 4], [one, two], np.zeros(7, np.int64)), np.zeros(7))
    data, nbytes = acp.encode_streams(np.zeros(0, np.int64), np.zeros(0, np.int64), one)
    assert data == b"" and nbytes.size == 0


def test_inputs_are_checked():
    t = ac.make_table([1, 1, 1])
    with pytest.raises(ValueError):
        acp.encode_streams([0, 3], [2], t)                           # outside the alphabet
    with pytest.raises(ValueError):
        acp.encode_streams([0, 1], [3], t)                           # lengths do not add up
    with pytest.raises(ValueError):
        acp.decode_streams(b"\x01", [2], [1], t)                     # byte counts do not add up
    with pytest.raises(ValueError):
        acp.decode_streams(b"", [0], [1], ac.make_table(np.ones(acp._LOOKUP_MAX_SIZE + 1)))


# ---------------------------------------------------------------------------- damaged input, empty slices
def test_damaged_streams_decode_as_the_serial_coder_does():
    """Flipped bits, truncations, random bytes: the parallel decoder raises CorruptStream exactly
    when the serial decoder does on one of the streams, and otherwise returns what it returns."""
    rng = np.random.default_rng(3)
    tables, lengths, ids, syms = _streams(11, 8, 300, 5, False)
    data, nbytes = acp.encode_streams(syms, lengths, tables, ids)
    parts = [data[e - n:e] for e, n in zip(np.cumsum(nbytes).tolist(), nbytes.tolist())]
    for trial in range(60):
        bad = list(parts)
        j = int(rng.integers(len(bad)))
        if trial % 3 == 0 and bad[j]:
            b = bytearray(bad[j])
            b[rng.integers(len(b))] ^= 1 << int(rng.integers(8))
            bad[j] = bytes(b)
        elif trial % 3 == 1:
            bad[j] = bad[j][:int(rng.integers(len(bad[j]) + 1))]
        else:
            bad[j] = bytes(rng.integers(0, 256, int(rng.integers(1, 80)), dtype=np.uint8))
        serial = []
        for part, (n, i) in zip(bad, _each_stream(lengths, np.arange(syms.size), ids)):
            try:
                serial.append(ac.decode(part, tables, len(n), i))
            except ac.CorruptStream:
                serial = None
                break
        with within(10):
            try:
                parallel = acp.decode_streams(b"".join(bad), [len(p) for p in bad], lengths, tables, ids)
            except ac.CorruptStream:
                parallel = None
        assert (parallel is None) == (serial is None)
        if serial is not None:
            assert np.array_equal(parallel, np.concatenate(serial))


def test_zero_width_slice_is_refused_by_both_coders_without_looping():
    """A table may hold a slice of zero width (make_table never makes one): coding its symbol is a
    ValueError, and a code value that falls on it (here: past the end of a table whose last slice is
    empty and whose total falls short) is CorruptStream, in both coders and without hanging."""
    empty_first = ac.FreqTable((0, 0, ac.AC_TOTAL))
    short = ac.FreqTable((0, 40000, 40000))
    with within(10):
        with pytest.raises(ValueError, match="zero width"):
            ac.encode(np.array([0]), empty_first)
        with pytest.raises(ValueError, match="zero width"):
            acp.encode_streams(np.array([1, 0]), [1, 1], empty_first)
        with pytest.raises(ValueError, match="zero width"):
            ac.encode(np.array([0, 1]), short)
        with pytest.raises(ValueError, match="zero width"):
            acp.encode_streams(np.array([0, 1]), [2], short)
        for data in (b"\xff" * 8, b"\xa0" * 8):                  # a code value at 40000 or above
            with pytest.raises(ac.CorruptStream):
                ac.decode(data, short, 5)
            with pytest.raises(ac.CorruptStream):
                acp.decode_streams(data + b"\x00", [len(data), 1], [5, 2], short)
        # the empty slice itself is never decoded: every code value lies in the other one
        assert np.array_equal(ac.decode(b"\x12\x34", empty_first, 50), np.ones(50))
        assert np.array_equal(acp.decode_streams(b"\x12\x34", [2], [50], empty_first), np.ones(50))


# ---------------------------------------------------------------------------- the codec's stream layouts
L, C = 4, 32


def _kv(seed, n, T):
    rng = np.random.default_rng(seed)
    walk = np.cumsum(0.3 * rng.standard_normal((n, T, L, 2, C)), 1)
    return (walk + rng.standard_normal((n, 1, L, 2, C))).astype(np.float32)


@pytest.fixture(scope="module")
def specs():
    Xc = _kv(0, 40, 30)
    steps = np.sqrt((Xc ** 2).mean(axis=(0, 1, 4))) / 8
    return {d: kv.fit_codec(Xc, steps, d) for d in (True, False)}


@pytest.mark.parametrize("layout", kv.STREAM_LAYOUTS)
@pytest.mark.parametrize("delta", [True, False])
def test_every_layout_roundtrips_and_groups_decode_alone(specs, layout, delta):
    spec = specs[delta]
    X = _kv(7, 3, 37)                                               # groups of 10, 10, 10, 7 tokens
    streams = kv.codec_encode_many(X, spec, layout)
    assert streams[1] == kv.codec_encode(X[1], spec, layout)       # a context alone: the same bytes
    assert kv.codec_header(streams[0])["layout"] == layout
    q = kv.codec_decode_many(streams, spec)
    assert all(np.array_equal(a, b) for a, b in zip(q, kv.quantize(X, spec)))
    for g in (3, 1):
        rows = slice(10 * g, 10 * g + 10)
        alone = kv.codec_decode(streams[2], spec, groups=[g])
        assert np.array_equal(alone[rows], q[2][rows]) and not alone[:10].any()


def test_bitstreams_of_every_layout_and_length_decode_together(specs):
    """One call decodes contexts of 3, 10 and 37 tokens in different layouts side by side (the channel
    layout's groups read in place as lanes, the others' streams laid end to end), each as it decodes alone."""
    spec = specs[True]
    Xs = [_kv(11, 1, 3)[0], _kv(12, 1, 37)[0], _kv(13, 1, 10)[0], _kv(14, 1, 37)[0]]
    streams = [kv.codec_encode(X, spec, layout) for X, layout in zip(Xs, ["channel", "channel", "layer", "group"])]
    together = kv.codec_decode_many(streams, spec)
    for q, X, data in zip(together, Xs, streams):
        assert np.array_equal(q, kv.quantize(X, spec)) and np.array_equal(q, kv.codec_decode(data, spec))


def test_decode_lanes_is_decode_streams_on_columns():
    """decode_lanes reads a (steps, lanes) matrix of streams of equal length: lane j is stream j."""
    rng = np.random.default_rng(5)
    tables = [ac.make_table(rng.random(n) + 0.01) for n in (5, 300, 2)]
    steps, lanes = 7, 300
    ids = rng.integers(0, 3, (steps, lanes))
    syms = np.minimum(rng.integers(0, 300, (steps, lanes)), np.array([4, 299, 1])[ids])
    data, nbytes = acp.encode_streams(syms.T.ravel(), np.full(lanes, steps), tables, ids.T.ravel())
    assert np.array_equal(acp.decode_lanes(data, nbytes, ids, tables), syms)
    with pytest.raises(ValueError):
        acp.decode_lanes(data, nbytes[:-1], ids, tables)


def test_decode_lanes_repeats_fewer_columns_across_the_lanes():
    """table_ids of P columns for P x k lanes: lane j reads column j % P (several groups of the channel layout
    side by side), across blocks of lanes that do not start at a multiple of P."""
    rng = np.random.default_rng(6)
    tables = [ac.make_table(rng.random(n) + 0.01) for n in (5, 300, 2)]
    steps, P, k = 4, 7, -(-2 * acp.PARALLEL_BLOCK // 7) + 1
    ids = rng.integers(0, 3, (steps, P))
    full = np.tile(ids, (1, k))
    syms = np.minimum(rng.integers(0, 300, full.shape), np.array([4, 299, 1])[full])
    data, nbytes = acp.encode_streams(syms.T.ravel(), np.full(P * k, steps), tables, full.T.ravel())
    assert np.array_equal(acp.decode_lanes(data, nbytes, ids, tables), syms)
    assert np.array_equal(acp.decode_lanes(data, nbytes, full, tables), syms)
    with pytest.raises(ValueError):
        acp.decode_lanes(data, nbytes[:-1], ids, tables)


def test_one_stream_per_group_is_the_serial_coder_in_token_order(specs):
    spec = specs[True]
    X = _kv(8, 1, 23)[0]
    data = kv.codec_encode(X, spec, "group")
    h = kv.codec_header(data)
    syms, ids = kv.symbols(kv.quantize(X, spec), spec)
    at = h["payload_start"]
    for g, n in enumerate(h["group_bytes"]):
        rows = slice(10 * g, 10 * g + 10)
        assert data[at:at + n] == ac.encode(syms[rows].ravel(), spec.tables, ids[rows].ravel())
        at += n


def test_stream_plan_keeps_its_budget_and_its_estimate(specs):
    """The plan's expected added bytes (each extra stream: its end and its length) match the bytes
    really added within a fifth, the chosen layout stays within STREAM_BUDGET, and a context too short
    to give the parallel coder PARALLEL_MIN_STREAMS streams keeps one stream per group."""
    spec = specs[False]
    X = _kv(9, 20, 30)
    base = sum(map(len, kv.codec_encode_many(X, spec, "group")))
    n_groups = 20 * 3
    for plan in kv.stream_plans(spec):
        added = sum(map(len, kv.codec_encode_many(X, spec, plan.layout))) - base
        assert added / n_groups == pytest.approx(plan.added_bytes, rel=0.2, abs=0.5)
    chosen = kv.stream_plan(spec, 10_000)
    assert chosen.streams == 1 or chosen.added_share <= kv.STREAM_BUDGET
    assert all(p.added_share > kv.STREAM_BUDGET for p in kv.stream_plans(spec) if p.streams > chosen.streams)
    assert kv.stream_plan(spec, 30).layout == "group"               # 3 groups: too few streams
    assert kv.coder_for(kv.PARALLEL_MIN_STREAMS) == "parallel" and kv.coder_for(kv.PARALLEL_MIN_STREAMS - 1) == "serial"


def test_stream_plan_by_time_weighs_bytes_at_a_bandwidth_against_decode(specs):
    """With a bandwidth and each layout's decode seconds, the layout of least bytes / bandwidth + decode: the
    fastest decode over a fast link, the fewest bytes over a slow one, and the switch where both take as long;
    its expected bytes are a real bitstream's within a tenth. Without a bandwidth, the bytes-only rule."""
    spec, T = specs[False], 30
    X = _kv(10, 4, T)
    nbytes = {p.layout: kv.context_bytes(spec, T, p) for p in kv.stream_plans(spec)}
    for layout, n in nbytes.items():
        assert np.mean([len(d) for d in kv.codec_encode_many(X, spec, layout)]) == pytest.approx(n, rel=0.1)
    decode = {"group": 4.0, "K/V": 3.0, "layer": 0.5, "channel": 0.1}
    assert kv.stream_plan(spec, T, 1e3, decode).layout == "channel"
    assert kv.stream_plan(spec, T, 1e-12, decode).layout == min(nbytes, key=nbytes.get)
    switch = (nbytes["channel"] - nbytes["layer"]) / (decode["layer"] - decode["channel"]) / 1e9
    assert kv.stream_plan(spec, T, switch * 1.01, decode).layout == "channel"
    assert kv.stream_plan(spec, T, switch * 0.99, decode).layout == "layer"
    assert kv.stream_plan(spec, T).layout == "group"                # the bytes-only rule, as 02's tables use it
    with pytest.raises(ValueError):
        kv.stream_plan(spec, T, 1.0, {"channel": 0.1})


def test_a_sampled_context_holds_the_codecs_own_symbols(specs):
    """sample_context draws each value from its table: in range, and its mean bits near the tables' entropy."""
    spec = specs[True]
    q = kv.sample_context(spec, 40, seed=1)
    assert q.shape == (40, *spec.shape) and np.abs(q).max() <= max(spec.radius.max(), kv.ANCHOR_MAX)
    plan = kv.stream_plans(spec)[0]
    assert kv.codec_bits(spec, kv.dequantize(q, spec)[None]) / 8 == pytest.approx(plan.group_bytes * 4, rel=0.1)


@pytest.mark.parametrize("max_steps", [10_000, 50])
def test_the_benchmark_counts_the_bytes_streams_add(monkeypatch, max_steps):
    """coder_bench.coder_throughput: at each stream count, the bytes added to one stream are the streams'
    own bytes and the varints of their lengths (all but the last), less the one stream's; the same when
    the streams are timed on their first THROUGHPUT_MAX_STEPS symbols only (50 < 80 and 240 here)."""
    monkeypatch.setattr(bench, "THROUGHPUT_MAX_STEPS", max_steps)
    rng = np.random.default_rng(3)
    tables = [ac.make_table(rng.random(9) + 0.01) for _ in range(4)]
    R, n = 6, 40
    ids, syms = np.repeat(np.arange(R) % 4, n).reshape(R, n), rng.integers(0, 9, (R, n))
    thr = bench.coder_throughput(syms, ids, tables, (1, 3, 100))
    assert thr.symbols == R * n and thr.streams == (1, 3, R)
    assert thr.one_stream_bytes == len(ac.encode(syms.ravel(), tables, ids.ravel()))
    for k, added in zip(thr.streams, thr.added_bytes):
        sizes = [len(ac.encode(syms[r].ravel(), tables, ids[r].ravel())) for r in np.array_split(np.arange(R), k)]
        assert added == sum(sizes) + sum(len(acp.varint(b)) for b in sizes[:-1]) - thr.one_stream_bytes
    assert thr.added_bytes[0] == 0 and thr.added_bytes[-1] > thr.added_bytes[1] > 0
    assert min(thr.serial_encode, thr.serial_decode, *thr.parallel_encode, *thr.parallel_decode) > 0


@pytest.mark.parametrize("top", [100, 1 << 20])
def test_read_varint_runs_is_read_varints_at_each_start(top):
    """Runs of varints read at once equal read_varints run by run: lengths below 128 (one byte each, the channel
    layout's) and longer ones."""
    rng = np.random.default_rng(int(top))
    runs = [rng.integers(0, top, 5) for _ in range(4)]
    data = b"".join(b"\xff" + b"".join(acp.varint(int(n)) for n in r) for r in runs)
    starts, pos = [], 0
    for r in runs:
        starts.append(pos + 1)
        pos += 1 + sum(len(acp.varint(int(n))) for n in r)
    values, after = acp.read_varint_runs(np.frombuffer(data, np.uint8), starts, 5, "lengths")
    for r, s, v, a in zip(runs, starts, values, after):
        assert (list(v), a) == acp.read_varints(data, s, 5, "lengths") and list(v) == r.tolist()


def test_fastest_stops_repeating_once_a_call_is_long_enough():
    """clock.fastest: the fewest seconds of its calls; a call of enough_s or more is the last (a fake clock)."""
    from common.clock import fastest
    for durations, enough, calls, best in (([3.0, 1.0, 2.0], float("inf"), 3, 1.0), ([0.5, 2.0, 1.0], 1.5, 2, 0.5),
                                           ([2.0, 0.1, 0.1], 1.0, 1, 2.0)):
        ticks, made = iter([t for d in durations for t in (0.0, d)]), []
        out, got = fastest(lambda: made.append(1) or len(made), 3, clock=lambda: next(ticks), enough_s=enough)
        assert (len(made), got, out) == (calls, best, calls)


def test_a_sampled_context_is_the_same_searched_down_columns_as_across_tokens(specs):
    """sample_context searches the stack's keys column by column (faster); each value is the one a search across a
    token's values finds."""
    spec, T = specs[True], 25
    stack, ids = spec.stack, kv._table_ids(T, spec)
    u = np.random.default_rng(5).integers(0, kv.AC_TOTAL, ids.shape)
    at = np.searchsorted(stack.keys, ids << (kv.AC_PRECISION + 1) | u, "right") - 1
    L, _, C = spec.shape
    offset = np.concatenate([np.repeat(np.asarray(spec.radius).ravel(), C), np.full(L * 2 * C, kv.ANCHOR_MAX)])
    want = (at - stack.start[ids] - offset[ids]).astype(np.int32).reshape(T, *spec.shape)
    assert np.array_equal(kv.sample_context(spec, T, seed=5), want)

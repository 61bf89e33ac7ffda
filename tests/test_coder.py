"""The arithmetic (range) coder of coder.py: quantized tables, bit-exact round trips,
length against the ideal -sum log2 p and against constriction, exercise 4, damaged input, tables with
an empty slice."""
import contextlib
import signal

import numpy as np
import pytest
from hypothesis import given, settings, strategies as hs

from lecture27 import coder as ac


@contextlib.contextmanager
def within(seconds: float):
    """Fail a block that runs longer than `seconds` (a coder loop that never ends) instead of hanging."""
    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a loop that never ends")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _table_and_symbols(seed, K, n, skew, uniform_symbols):
    """A random table whose smallest entries sit at the coder's minimum (frequency 1 of 2^16), and
    n symbols drawn from it or uniformly (so rare symbols are coded often)."""
    rng = np.random.default_rng(seed)
    counts = rng.dirichlet(np.full(K, skew)) * rng.integers(0, 2, K)  # some zero counts
    counts[rng.integers(K)] += 1.0                                     # not all zero
    table = ac.make_table(counts)
    p = np.full(K, 1 / K) if uniform_symbols else table.probs()
    return table, rng.choice(K, size=n, p=p)


def _roundtrip_and_length(table_or_tables, syms, ids=None):
    data = ac.encode(syms, table_or_tables, ids)
    back = ac.decode(data, table_or_tables, len(syms), ids)
    assert back.dtype == np.int64 and np.array_equal(back, syms)     # bit-exact
    ideal = ac.ideal_bits(syms, table_or_tables, ids) / 8
    assert len(data) <= ideal + 2
    return len(data), ideal


# ---------------------------------------------------------------------------------- tables
def test_make_table_quantizes_to_total_with_no_zero():
    t = ac.make_table([0, 1e-12, 5, 0.5, 1e6])
    f = np.diff(t.cdf)
    assert t.cdf[0] == 0 and t.cdf[-1] == ac.AC_TOTAL == 2 ** 16
    assert f.min() == 1 and f[0] == 1 and f[1] == 1                  # zero counts still codable
    assert ac.make_table([2, 1, 1]).probs().tolist() == [0.5, 0.25, 0.25]
    assert ac.make_table(np.ones(ac.AC_TOTAL)).probs().min() == 1 / ac.AC_TOTAL


def reference_table(p):
    """make_table's rule written the slow, obvious way: round p x 2^16 (at least 1), then walk the
    entries from the largest (stable order), taking an excess from each until it is gone (each keeps
    at least 1), or giving a shortfall all to the largest."""
    p = np.asarray(p, np.float64)
    f = np.maximum(1, np.round(p / p.sum() * ac.AC_TOTAL)).astype(np.int64)
    excess = int(f.sum()) - ac.AC_TOTAL
    for s in np.argsort(-f, kind="stable"):
        take = min(excess, int(f[s]) - 1)
        f[s] -= take
        excess -= take
        if excess == 0:
            break
    return (0, *np.cumsum(f).tolist())


def test_make_tables_row_by_row_equals_the_reference_rule():
    """The vectorized make_tables (a codec's 11,520 tables at once) against reference_table, on rows of
    different lengths side by side (padding must not leak between rows): skewed, flat, sparse, huge
    counts, alphabets of 1 to 400 symbols (excess and shortfall both occur)."""
    rng = np.random.default_rng(1)
    rows = []
    for i in range(600):
        K = int(rng.integers(1, 400))
        p = [rng.dirichlet(np.full(K, 0.03)), rng.random(K), rng.integers(0, 3, K) * 1e9,
             rng.dirichlet(np.full(K, 3.0))][i % 4]
        p[rng.integers(K)] += 1.0
        rows.append(p)
    M = max(map(len, rows))
    counts = np.zeros((len(rows), M))
    for i, r in enumerate(rows):
        counts[i, :len(r)] = r
        counts[i, len(r):] = rng.random(M - len(r)) * 1e6  # garbage beyond the row's size: ignored
    tables = ac.make_tables(counts, [len(r) for r in rows])
    assert [t.cdf for t in tables] == [reference_table(r) for r in rows]
    assert all(ac.make_table(r).cdf == reference_table(r) for r in rows[:50])


@pytest.mark.parametrize("bad", [[], [0, 0], [1, -1], [1, np.nan], [1, np.inf],
                                 np.ones(ac.AC_TOTAL + 1)])
def test_make_table_rejects_bad_counts(bad):
    with pytest.raises(ValueError):
        ac.make_table(bad)


def test_encode_rejects_symbols_outside_the_alphabet():
    t = ac.make_table([1, 1, 1])
    for syms in ([3], [-1], [0.5]):
        with pytest.raises(ValueError):
            ac.encode(syms, t)
    with pytest.raises(ValueError):                                  # symbol 2 but its table has 2
        ac.encode([0, 2], [t, ac.make_table([1, 1])], [0, 1])
    with pytest.raises(ValueError):
        ac.encode([0, 1], [t], [0])                                  # one table id per symbol


# ------------------------------------------------------------------------------ round trips
@settings(max_examples=40, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), K=hs.integers(1, 300), skew=hs.sampled_from([0.05, 0.3, 3.0]),
       n=hs.one_of(hs.integers(0, 40), hs.integers(0, 100_000)), uniform_symbols=hs.booleans())
def test_roundtrip_single_table(seed, K, skew, n, uniform_symbols):
    table, syms = _table_and_symbols(seed, K, n, skew, uniform_symbols)
    _roundtrip_and_length(table, syms)


@settings(max_examples=25, deadline=None)
@given(seed=hs.integers(0, 2 ** 32 - 1), n_tables=hs.integers(1, 40), n=hs.integers(0, 20_000))
def test_roundtrip_per_symbol_tables(seed, n_tables, n):
    rng = np.random.default_rng(seed)
    tables = [_table_and_symbols(seed + j, int(rng.integers(1, 64)), 0, 0.2, False)[0]
              for j in range(n_tables)]
    ids = rng.integers(n_tables, size=n)
    sizes = np.array([t.size for t in tables])
    syms = (rng.random(n) * sizes[ids]).astype(np.int64)              # uniform within each alphabet
    _roundtrip_and_length(tables, syms, ids)


def carry_case(case: str, n: int):
    """(table, n symbols): the near-certain symbol at the top of the CDF ("top"), at its bottom
    ("bottom": all-zero bytes), or at the top with rare others ("alternate")."""
    if case == "top":
        return ac.make_table([1e-9, 1]), np.ones(n, np.int64)
    if case == "bottom":
        return ac.make_table([1, 1e-9]), np.zeros(n, np.int64)
    syms = np.where(np.arange(n) % 5000 == 4999, 2, 1)
    syms[::7919] = 0
    return ac.make_table([1e-9, 1, 1e-9]), syms


@pytest.mark.parametrize("case", ["top", "bottom", "alternate"])
def test_long_carry_runs(case):
    """The near-certain symbol at the top of the CDF keeps low near the top of the window: long
    runs of 0xFF bytes that a later carry must flip (the pending bytes)."""
    _roundtrip_and_length(*carry_case(case, 100_000))


def test_long_sequences_are_close_to_ideal():
    for seed, K in [(1, 5), (2, 256)]:
        table, syms = _table_and_symbols(seed, K, 100_000, 0.3, False)
        actual, ideal = _roundtrip_and_length(table, syms)
        assert abs(actual - ideal) <= 1.5


def test_length_law_over_many_streams():
    """The coder's length law, over 2,000 short streams of random tables.

    Coding narrows [0, 1) to an interval of width W = prod p = 2^-I (I = the ideal -sum log2 p bits);
    the coder then writes the number in that interval with the fewest bytes. A multiple of 2^-8L lies
    in any interval of width >= 2^-8L, so L <= ceil(I / 8) bytes always suffice (plus < 1e-7 bits per
    symbol lost to the 48-bit window): actual <= ideal + 1 byte. It can also be *shorter* than the
    ideal, when a number with j fewer bytes happens to fall in the interval (probability ~ 2^-8j):
    so actual > ideal - 3 bytes except with probability ~ 2^-16 per stream, and on average the coder
    writes about a third of a byte more than the ideal."""
    rng = np.random.default_rng(0)
    excess = []
    for _ in range(2000):
        K = int(rng.integers(2, 64))
        table = ac.make_table(rng.dirichlet(np.full(K, 0.3)))
        syms = rng.choice(K, size=int(rng.integers(1, 400)), p=table.probs())
        data = ac.encode(syms, table)
        assert np.array_equal(ac.decode(data, table, len(syms)), syms)
        excess.append(len(data) - ac.ideal_bits(syms, table) / 8)
    excess = np.array(excess)
    assert excess.max() <= 1.01 and excess.min() > -3
    assert 0.1 < excess.mean() < 0.6                   # measured 0.32
    assert (excess < 0).mean() > 0.05                  # shorter than "ideal" is ordinary, not a bug


def test_empty_and_single_symbol():
    t = ac.make_table([1, 3])
    assert ac.encode([], t) == b"" and ac.decode(b"", t, 0).size == 0
    one = ac.make_table([5])                           # a one-symbol alphabet costs 0 bits
    assert ac.encode(np.zeros(1000, int), one) == b""
    assert np.array_equal(ac.decode(b"", one, 1000), np.zeros(1000))


def test_length_matches_constriction():
    constriction = pytest.importorskip("constriction")
    table, syms = _table_and_symbols(7, 16, 100_000, 0.5, False)
    model = constriction.stream.model.Categorical(table.probs(), perfect=False)
    enc = constriction.stream.queue.RangeEncoder()
    enc.encode(syms.astype(np.int32), model)
    theirs = 4 * enc.get_compressed().size                            # 32-bit words
    ours = len(ac.encode(syms, table))
    assert abs(ours - theirs) <= 0.005 * theirs


# ----------------------------------------------------------------------------- exercise 4
def test_exercise4_numbers():
    r = ac.exercise4({0: 0.70, 1: 0.12, -1: 0.12, 2: 0.03, -2: 0.03}, n=100_000, seed=0)
    assert round(r["entropy_bits"], 2) == 1.40
    assert r["fixed_bits"] == 3
    assert abs(r["coded_bits_per_symbol"] - r["entropy_bits"]) < 0.02
    assert r["coded_bits_per_symbol"] <= r["ideal_bits_per_symbol"] + 16 / 100_000
    assert r["roundtrip_exact"]


# --------------------------------------------------------------------------- damaged input
def _decode_or_error(data, table, n):
    try:
        return ac.decode(data, table, n)
    except ac.CorruptStream:
        return "error"


def test_corrupted_and_truncated_input_ends():
    rng = np.random.default_rng(3)
    table, syms = _table_and_symbols(3, 40, 20_000, 0.3, False)
    data = ac.encode(syms, table)
    damaged = [data[:k] for k in (0, 1, len(data) // 2, len(data) - 1)]
    for _ in range(20):
        b = bytearray(data)
        b[rng.integers(len(b))] ^= 1 << int(rng.integers(8))
        damaged.append(bytes(b))
    damaged += [bytes(rng.integers(0, 256, 3000, dtype=np.uint8)), b"\xff" * 100]
    for d in damaged:
        first, again = _decode_or_error(d, table, len(syms)), _decode_or_error(d, table, len(syms))
        if isinstance(first, str):
            assert again == "error"
        else:                                                         # deterministic, n symbols
            assert len(first) == len(syms) and np.array_equal(first, again)
            assert first.min() >= 0 and first.max() < table.size
    # a value no encoder can produce is reported, not decoded into nonsense
    with pytest.raises(ac.CorruptStream, match="outside every symbol"):
        ac.decode(b"\xff" * 64, ac.make_table([3, 5, 7]), 1000)
    with pytest.raises(ValueError):
        ac.decode(data, table, -1)


# ------------------------------------------------------------------------------ empty slices
def test_a_zero_width_slice_is_an_error_not_a_hang():
    """encode(np.array([0]), FreqTable((0, 0, 65536))): symbol 0 has nothing to narrow to. It is
    refused (ValueError), as is a code value that falls on an empty slice (CorruptStream), in bounded
    time (the parallel coder: test_coder_parallel)."""
    with within(10):
        with pytest.raises(ValueError, match="zero width"):
            ac.encode(np.array([0]), ac.FreqTable((0, 0, ac.AC_TOTAL)))
        with pytest.raises(ValueError, match="zero width"):
            ac.encode([1, 1, 2], [ac.make_table([1, 1]), ac.FreqTable((0, 9, 9, ac.AC_TOTAL))], [0, 1, 1])
        with pytest.raises(ac.CorruptStream, match="no symbol's slice"):
            ac.decode(b"\xff" * 8, ac.FreqTable((0, 40000, 40000)), 3)

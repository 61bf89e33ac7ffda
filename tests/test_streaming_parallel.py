"""streaming.py's two models of a fetch. Parallel (the default): the link and the GPU work at once, a text
chunk occupies the GPU while the next chunk's transfer starts on the link, and the recompute of chunk i
waits only for the chunks before it. Serial: one chunk at a time. The oracle must stay the best schedule
under either model (checked by brute force). Levels are synthetic, as in test_streaming.py."""

import pytest
from hypothesis import given, settings, strategies as hs

from lecture27 import streaming as st
from lecture27.stream import oracle as so
from common import timemodel as tm
from test_streaming import HANDOUT_TRACE, LEVELS, REAL_SIZE_LEVELS, SMALL_LEVELS, brute_force, setup, traces

IDS_BITS = 1536 * 32                          # a 1,536-token chunk's token ids, 32 bits each
L0_BITS = 4.8 * 163_840 * 1536                # LEVELS' level0: 4.8 bits x 163,840 values x 1,536 tokens
SLOWDOWN_1536 = (1 + 128 / 1536) / (1 + 128 / 12_288)       # streaming.batch_slowdown(1536)
RC0 = tm.prefill_time("llama-3.1-70b", "A100-80GB", 1536, 0, 4) * SLOWDOWN_1536   # recompute chunk 0
# the sizes of the record-world levels in the cached codec study (02), rounded
RECORD_SIZE_LEVELS = [dict(level=i, bits_per_value=b, accuracy=a) for i, (b, a) in
                      enumerate([(1.61, 0.9999), (1.31, 0.9982), (1.08, 0.9978), (0.87, 0.9966)])]
# the trace of the streaming issue: a 20 Gb/s burst while the serial model recomputes with the link idle
BURST_TRACE = st.Trace((0.0, 0.5, 1.5, 2.0), (3.0, 0.3, 20.0, 0.8))


# --------------------------------------------------------------------------------- the two chunks
@pytest.mark.parametrize("gbps, by_hand", [
    (1.0, 49.152e-6 + 1.207959552),           # the link is the bottleneck: ids of chunk 0, then level0 of chunk 1
    (10.0, 4.9152e-6 + 0.3631603012)])        # the GPU is: ids of chunk 0, then its recompute
def test_two_chunks_the_first_as_text(gbps, by_hand):
    """Chunk 0 as text, chunk 1 at level0: chunk 1's transfer starts when chunk 0's recompute starts (its
    token ids are in), not when the recompute ends; the context is in at the later of the two."""
    s = setup(context=3072)
    trace = st.Trace.steady(gbps)
    assert RC0 == pytest.approx(0.3631603012, rel=1e-9)
    text, kv = st.replay(s, trace, ["text", "level0"], parallel=True).rows
    ids_s, kv_s = IDS_BITS / (gbps * 1e9), L0_BITS / (gbps * 1e9)
    assert text["link_end"] == text["gpu_start"] == pytest.approx(ids_s, rel=1e-12)
    assert kv["start"] == text["gpu_start"] < text["finish"]
    assert text["finish"] == pytest.approx(ids_s + RC0, rel=1e-12) and text["gpu_s"] == pytest.approx(RC0)
    assert kv["finish"] == pytest.approx(ids_s + kv_s, rel=1e-12) and kv["gpu_s"] == 0
    r = st.replay(s, trace, ["text", "level0"], parallel=True)
    assert r.ttft_s == pytest.approx(by_hand, rel=1e-9) == max(ids_s + RC0, ids_s + kv_s)
    serial = st.replay(s, trace, ["text", "level0"], parallel=False)
    assert serial.rows[1]["start"] == serial.rows[0]["finish"]          # serially it waits for the recompute
    assert serial.ttft_s == pytest.approx(ids_s + RC0 + kv_s, rel=1e-12)


@pytest.mark.parametrize("gbps", [0.01, 1.0, 10.0, 100.0])
def test_always_text_is_unchanged(gbps):
    """Always text: only the GPU works, so the parallel model changes nothing but the token ids of chunks
    1-7, which now cross the link while the chunk before is recomputed (7 x 4.9 ms at 10 Mb/s, 34 us at
    1 Gb/s): the same recompute seconds, the same TTFT to within those ids."""
    s = setup()
    par, ser = (st.fixed(s, st.Trace.steady(gbps), "text", parallel=p) for p in (True, False))
    ids_s = IDS_BITS / (gbps * 1e9)
    assert par.gpu_s == ser.gpu_s and par.choices == ser.choices == ["text"] * 8
    assert par.ttft_s == pytest.approx(ids_s + par.gpu_s, rel=1e-12)
    assert ser.ttft_s - par.ttft_s == pytest.approx(7 * ids_s, rel=1e-6)
    assert ser.ttft_s - par.ttft_s <= 0.035


def test_always_kv_is_unchanged():
    """A fixed KV level never uses the GPU: both models give the same schedule to the bit."""
    s = setup(context=48 * 1024, levels=RECORD_SIZE_LEVELS)
    for trace in (HANDOUT_TRACE, BURST_TRACE):
        for name in ("level0", "level3"):
            par, ser = (st.fixed(s, trace, name, parallel=p) for p in (True, False))
            assert par.rows == ser.rows and par.ttft_s == ser.ttft_s


# ------------------------------------------------------------------------------ the replay itself
choices = hs.lists(hs.sampled_from(["level0", "level1", "level2", "level3", "text"]), min_size=8, max_size=8)


@settings(max_examples=100, deadline=None)
@given(traces, choices)
def test_the_two_resources(trace, names):
    """Any schedule: the link carries the chunks in order, each starting when the one before is across;
    the GPU recomputes text chunks in order, each once its ids are in and the recompute before it is
    done; TTFT is the last chunk ready. The serial model runs the same choices no faster."""
    s = setup()
    r = st.replay(s, trace, names, parallel=True)
    gpu_free = 0.0
    for k, row in enumerate(r.rows):
        assert row["start"] == (r.rows[k - 1]["link_end"] if k else 0.0)
        if row["choice"] == "text":
            assert row["gpu_start"] == max(row["link_end"], gpu_free)
            gpu_free = row["finish"]
        else:
            assert row["gpu_start"] is None and row["finish"] == row["link_end"]
    assert r.ttft_s == max(row["finish"] for row in r.rows)
    serial = st.replay(s, trace, names, parallel=False)
    assert all(b["start"] == a["finish"] for a, b in zip(serial.rows, serial.rows[1:]))
    assert r.ttft_s <= serial.ttft_s + 1e-12 and r.gpu_s == serial.gpu_s


# -------------------------------------------------------------------------------- the adaptive policy
def test_the_burst_is_used_during_the_recompute():
    """The streaming issue's trace (3 Gb/s, 0.3 Gb/s from 0.5 s, a 20 Gb/s burst from 1.5 s to 2 s, then 0.8),
    48K tokens, record-sized levels, SLO 4 s. Serially the policy recomputes a text chunk during the burst
    with the link idle and misses the SLO, which always level0 meets; in parallel the next chunk is
    fetched during that recompute, in the burst, and the SLO is met."""
    s = setup(context=48 * 1024, levels=RECORD_SIZE_LEVELS)
    par, ser = (st.adaptive(s, BURST_TRACE, 4.0, parallel=p) for p in (True, False))
    assert st.fixed(s, BURST_TRACE, "level0", parallel=True).ttft_s <= 4.0 < ser.ttft_s
    assert par.ttft_s <= 4.0
    k = par.choices.index("text")
    text, after = par.rows[k], par.rows[k + 1]
    assert 1.5 <= text["gpu_start"] < 2.0 and after["start"] == text["gpu_start"]
    assert after["finish"] < text["finish"] and after["measured_gbps"] == pytest.approx(20)
    k = ser.choices.index("text")
    assert ser.rows[k + 1]["start"] == ser.rows[k]["finish"] > 1.5


def test_a_recovery_is_seen_while_the_gpu_recomputes():
    """10 Gb/s, 0.3 Gb/s from 0.2 s, 20 Gb/s from 1.7 s. A level0 chunk is given up and recomputed from 1.55
    to 1.93 s. The next chunk would be text too (the estimate is 0.3 Gb/s), so rather than queue it the
    policy probes the idle link, sees the recovery one probe window after 1.7 s, and fetches level0 while
    the GPU still recomputes; without the probe the text chunks queue up on the stale estimate."""
    s = setup(levels=REAL_SIZE_LEVELS)
    tr = st.Trace((0.0, 0.2, 1.7), (10.0, 0.3, 20.0))
    r = st.adaptive(s, tr, 4.0, parallel=True)
    k = r.choices.index("text")
    given_up, nxt = r.rows[k], r.rows[k + 1]
    assert given_up["gave_up"] == "level0" and given_up["gpu_start"] < 1.7 < given_up["finish"]
    assert nxt["probe"] and nxt["start"] == pytest.approx(1.7 + st.PROBE_WINDOW_S)
    assert nxt["est_gbps"] == pytest.approx(20) and nxt["start"] < given_up["finish"]
    assert r.choices[k + 1:] == ["level0"] * (8 - k - 1) and r.text_tokens == 1536
    assert r.ttft_s < st.adaptive(s, tr, 4.0, parallel=False).ttft_s
    queued = st.adaptive(s, tr, 4.0, probe=False, parallel=True)
    assert queued.text_tokens >= 4 * 1536 and queued.ttft_s > r.ttft_s + 1


@pytest.mark.parametrize("levels", [SMALL_LEVELS, REAL_SIZE_LEVELS, LEVELS])
def test_a_text_chunk_waits_for_the_gpu_in_the_prediction(levels):
    """choose() sees a text chunk's recompute start only when the GPU is free: with the GPU busy for
    longer than any level takes, text is never the pick."""
    s = setup(levels=levels)
    chunk = s.plan[3]
    text = s.option("text")
    free = st.predict_s(s, chunk, text, 1.0)
    assert st.predict_s(s, chunk, text, 1.0, gpu_wait_s=2.0) == pytest.approx(2.0 + s.recompute_s(*chunk))
    assert st.predict_s(s, chunk, text, 1.0, gpu_wait_s=1e-7) == free
    slowest = max(st.predict_s(s, chunk, o, 1.0) for o in s.options if not o.recompute)
    assert st.choose(s, chunk, 1.0, 0.0, gpu_wait_s=slowest + 1)[0] != "text"


# --------------------------------------------------------------------------------------- the oracle
@settings(max_examples=60, deadline=None)
@given(traces, hs.floats(0.2, 6.0), hs.sampled_from([LEVELS, SMALL_LEVELS]), hs.booleans())
def test_oracle_is_the_best_schedule(trace, slo, levels, parallel):
    """Against every one of the 5^3 schedules of a 3-chunk context, in either model."""
    s = setup(chunk=2048, context=6144, levels=levels)
    o, b = so.oracle(s, trace, slo, parallel=parallel), brute_force(s, trace, slo, parallel)
    assert so.outcome_key(o, slo) == so.outcome_key(b, slo)


@pytest.mark.parametrize("slo", [0.3, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("levels", [LEVELS, SMALL_LEVELS])
def test_oracle_is_the_best_schedule_of_five_chunks(slo, levels):
    """5^5 schedules (the last chunk half as long), in the parallel model. The last trace is a case where
    two partial schedules differ in which clock is ahead: a search that compared the link clocks alone
    would keep the wrong one and arrive later among schedules that tie on text and quality."""
    s = setup(chunk=1024, context=4 * 1024 + 512, levels=levels)
    for trace in (HANDOUT_TRACE, BURST_TRACE, st.Trace((0.0, 0.1, 0.6), (5.0, 0.05, 2.0)),
                  st.Trace((0.0, 0.3846441702059365), (0.05, 1.0))):
        o, b = so.oracle(s, trace, slo, parallel=True), brute_force(s, trace, slo, True)
        assert so.outcome_key(o, slo) == so.outcome_key(b, slo)


def test_oracle_of_the_burst():
    """On the burst at 48K the oracle streams level0 throughout and meets the SLO; the parallel model cannot
    make the best schedule worse (it only lets work overlap)."""
    s = setup(context=48 * 1024, levels=RECORD_SIZE_LEVELS)
    par, ser = (so.oracle(s, BURST_TRACE, 4.0, parallel=p) for p in (True, False))
    assert par.choices == ["level0"] * 32 and par.ttft_s <= 4.0
    assert so.outcome_key(par, 4.0) <= so.outcome_key(ser, 4.0)

"""wire.py's paced socket and the runs on it (stream/: measure, wire_runs, simulated, compare), on a tiny
random LLaMA (a few ms per chunk).

No test here bounds a time: the machine is shared. What holds on any machine: the plan follows the
trace exactly (a pure function); bytes arrive as sent; a transfer never ends before its plan; a dead
sender raises WireTimeout and the run falls back to text; every run builds the right KV. Which connection
the receiver trusts, and what it accepts from it, are in test_wire_trust.py."""
import numpy as np
import pytest

from lecture27 import kvcache as kv
from lecture27 import kvstore as ks
from lecture27 import streaming as st
from lecture27.stream import wire_page
from lecture27 import wire
from lecture27.stream import compare
from lecture27.stream import measure
from lecture27.stream import simulated
from lecture27.stream import wire_runs
from lecture27.stream import wire_study as ws
from common.present import Page

SLOW = st.Trace((0.0, 0.05), (0.0008, 0.0003))   # Gb/s: a 6 KB chunk takes 60-160 ms
SLO_S = 0.3
# a chunk's decode seconds per stream layout: the most streams decode fastest, and the fewest-bytes layout
# ("group") is not the fastest, so a choice that ignores the link's rate cannot pass both ends
DECODE_S = {"group": 0.030, "K/V": 0.031, "layer": 0.040, "channel": 0.002}


def test_wire_scale_divides_bandwidths_only():
    assert wire.wire_scale(23_040) == pytest.approx(327_680 / 23_040)
    tr = wire.scaled(st.Trace((0.0, 0.3, 3.0), (10.0, 1.0, 5.0)), 4.0)
    assert tr.times == (0.0, 0.3, 3.0) and tr.gbps == (2.5, 0.25, 1.25)


@pytest.mark.parametrize("t0, nbytes", [(0.0, 100_000), (0.04, 70_001), (0.29, 16_384), (1.0, 5)])
def test_send_plan_follows_the_trace_rate(t0, nbytes):
    tr = st.Trace((0.0, 0.05, 0.3), (0.02, 0.001, 0.008))
    plan = wire.send_plan(tr, t0, nbytes, quantum=16_384)
    sent = [c for _, c in plan]
    assert sent[-1] == nbytes and all(0 < b - a <= 16_384 for a, b in zip([0] + sent, sent))
    for t, c in plan:     # by each write's time the link has carried exactly the bytes written so far
        assert tr.bits_by(t) - tr.bits_by(t0) == pytest.approx(8 * c, rel=1e-9)
    assert plan[-1][0] == pytest.approx(tr.transfer_end(t0, 8 * nbytes), rel=1e-12)


def test_bytes_received_equal_bytes_sent_in_order():
    rng = np.random.default_rng(1)
    payloads = {"a": [rng.bytes(n) for n in (40_000, 1, 16_384, 50_000)], "b": [rng.bytes(n) for n in (7, 9, 0, 3)]}
    with wire.Wire(st.Trace.steady(0.05), payloads) as w:
        w.start()
        got = [w.fetch(i, name) for i in range(4) for name in ("a", "b")]
    assert [g.data for g in got] == [payloads[n][i] for i in range(4) for n in ("a", "b")]
    assert all(g.crc_ok for g in got)
    for g in got:         # never before the plan: the last byte is read after the sender's last write
        assert g.asked <= g.planned <= g.sent <= g.last_byte
    assert w.proc.poll() is not None


def test_a_killed_sender_gives_a_clear_timeout():
    payloads = {"a": [bytes(40_000)] * 3}
    with wire.Wire(st.Trace.steady(0.05), payloads, faults=wire.Faults(die_after_bytes=50_000)) as w:
        w.start()
        assert w.fetch(0, "a").data == payloads["a"][0]
        with pytest.raises(wire.WireTimeout, match="chunk 1 .*connection lost"):
            w.fetch(1, "a")
    assert w.proc.poll() is not None


def test_killed_sender_falls_back_to_text_and_answers_right(tiny):
    model, prep = tiny
    first = len(prep.payloads["level0"][0])
    r = wire_runs.run(prep, model, SLOW, "level0", SLO_S, faults=wire.Faults(die_after_bytes=first + 1))
    assert r.fell_back and r.choices[0] == "level0" and r.choices[1:] == ["text"] * 3
    assert r.rows[1].lost and r.rows[1].arrival is None
    assert all(isinstance(x, wire_runs.WireChunk) for x in r.rows) and r.rows[0].arrival.chunk == 0
    assert r.same_answer and r.first_token_kl < 1e-3


def test_a_corrupt_chunk_is_recomputed_never_used(tiny):
    model, prep = tiny
    clean = wire_runs.run(prep, model, SLOW, "level0", SLO_S)
    bad = wire_runs.run(prep, model, SLOW, "level0", SLO_S, faults=wire.Faults(corrupt=frozenset({1})))
    assert clean.bytes_equal and not bad.bytes_equal
    assert bad.rows[1].why.startswith("recomputed") and [r.why for r in clean.rows] == [None] * 4
    assert bad.same_answer
    # chunk 1 recomputed from exact KV: the answer is at least as close to the full prefill's as with KV
    assert bad.first_token_kl <= clean.first_token_kl + 1e-6


def test_measured_setup_feeds_the_simulator_this_cpus_times(tiny):
    _, prep = tiny
    setup = simulated.measured_setup(prep)
    res = st.fixed(setup, SLOW, "level0", parallel=True)
    link, cpu = 0.0, 0.0      # by hand: each chunk paced, then decoded on the CPU in order
    for (first, n), dec in zip(prep.plan, prep.decode_s["level0"]):
        link = SLOW.transfer_end(link, setup.option("level0").bits_per_token * n)
        cpu = max(link, cpu) + dec
    assert res.ttft_s == pytest.approx(cpu, rel=1e-12)
    text = st.fixed(setup, SLOW, "text", parallel=True)
    assert text.gpu_s == pytest.approx(sum(prep.recompute_s), rel=1e-12)


@pytest.mark.parametrize("policy", ["adaptive", "level3", "text"])
def test_measured_beside_simulated_from_real_runs(tiny, policy):
    model, prep = tiny
    row = compare.compare(prep, model, SLOW, policy, SLO_S)
    assert set(row.entry()) == {"measured_ttft_s", "simulated_ttft_s", "measured_choices", "simulated_choices",
                                "measured_slo_met", "simulated_slo_met"}
    assert row.bytes_equal and row.same_answer
    assert row.measured_slo_met == (row.measured_ttft_s <= SLO_S)
    ready = row.measured_ready_s
    assert all(a < b for a, b in zip(ready, ready[1:])) and row.measured_ttft_s == ready[-1]
    if policy != "adaptive":
        assert row.measured_choices == row.simulated_choices == [policy] * 4
        # the wire never beats the link: each KV chunk's last byte is no earlier than the trace allows
        links = st.replay(simulated.measured_setup(prep), SLOW, [policy] * 4, parallel=True)
        assert all(m >= s["link_end"] for m, s in zip(ready, links.rows))
    gap = abs(row.measured_ttft_s - row.simulated_ttft_s) > compare.GAP_SHARE * row.measured_ttft_s
    assert (row.cause is not None) == gap
    assert row.cause is None or row.cause in row.parts_s or row.cause.startswith("choices")


def test_the_study_and_its_table_are_built_from_real_runs(tiny_inputs, monkeypatch):
    """wire_study.study_of on the tiny model, two traces x three policies: every chunk a run lists crossed a
    socket (each Wire.fetch is recorded as it happens, and the runs' link spans are those fetches' times, in
    order), the kill run lost a real sender, the --json holds exactly the spec's keys, and 03's table shows
    these runs."""
    model, ids, question, specs = tiny_inputs
    fetched, carried, real_fetch = [], [], wire.Wire.fetch

    def recording(self, chunk, option, give_up_at=None):
        a = real_fetch(self, chunk, option, give_up_at)
        if not a.given_up:
            carried.append((option, a.data))
        if option == "text" and fetched and fetched[-1][0] == chunk and fetched[-1][1] != "text":
            # its KV given up, or come whole too late to be decoded by the deadline, then its token ids: one span
            fetched[-1] = (chunk, option, fetched[-1][2], a.last_byte)
        else:
            fetched.append((chunk, "given up" if a.given_up else option, a.asked, a.last_byte))
        return a

    monkeypatch.setattr(wire.Wire, "fetch", recording)
    policies = ("adaptive", "level0", "text")
    lecture = {"handout": st.Trace((0.0, 0.05), (0.8, 0.3)), "steady": st.Trace.steady(0.8)}   # / 1000: SLOW's rates
    r = ws.study_of(model, ids, question, specs, lecture, 24, 1000.0, SLO_S, policies=policies)
    assert r.traces["handout"] == SLOW
    listed = [(i, ch, a, b) for by in r.runs.values() for c in by.values()
              for i, (ch, (a, b, _, _)) in enumerate(zip(c.measured_choices, c.measured_spans))]
    assert fetched[:len(listed)] == listed              # the study's runs, then the kill run's fetches
    assert len(fetched) > len(listed) and r.kill.rows[ws.KILL_CHUNK].lost.startswith(f"chunk {ws.KILL_CHUNK}")
    assert "connection lost" in r.kill.rows[ws.KILL_CHUNK].lost and r.kill_ok and r.bytes_equal
    for by in r.runs.values():
        assert by["level0"].measured_choices == by["level0"].simulated_choices == ["level0"] * 4
        assert by["text"].measured_choices == ["text"] * 4 and by["text"].same_answer
    # every KV chunk that came whole carries the layout chosen for its level at the handout trace's window rate
    assert r.layout_gbps == ws.window_gbps(SLOW, SLO_S)
    assert all(c.gbps == r.layout_gbps for c in r.layouts.values())
    kv_fetched = [(option, data) for option, data in carried if option != "text"]
    assert kv_fetched and all(kv.codec_header(data, lengths=False)["layout"] == r.layouts[option].layout
                              for option, data in kv_fetched)
    j = r.json()
    assert set(j) == {"wire_scale", "wire_runs", "wire_bytes_equal", "wire_kill_fallback_ok", "wire_first_token_kl",
                      "wire_layouts"}
    assert {name: x["layout"] for name, x in j["wire_layouts"].items()} == {n: c.layout for n, c in r.layouts.items()}
    assert j["wire_scale"] == 1000.0 and j["wire_kill_fallback_ok"] is True and j["wire_bytes_equal"] is True
    assert {t: set(by) for t, by in j["wire_runs"].items()} == {t: set(policies) for t in lecture}
    assert j["wire_first_token_kl"] == max(c.first_token_kl for by in r.runs.values() for c in by.values())
    assert 0 < r.answers_computed < len(policies) * len(lecture) + 1 and r.answers_reused > 0

    page = Page("03", "test", "§4", plot=False)
    wire_page.show_wire(page, r, None)
    layouts = next(t for t in page.tables if t.source == "stream.measure.choose_layouts")
    assert [row.cells[:2] for row in layouts.rows] == [[n, c.layout] for n, c in r.layouts.items()]
    table = page.tables[-1]
    cells = {(row.cells[0], row.cells[1]): row.cells for row in table.rows}
    assert set(cells) == {(t, p) for t in lecture for p in policies}
    for (t, p), row in cells.items():
        c = r.runs[t][p]
        assert row[2:5] == [c.measured_ttft_s, c.simulated_ttft_s, c.simulated_ttft_s / c.measured_ttft_s - 1]
        assert row[11] == (c.cause or "")
    assert page.json()["wire_runs"] == j["wire_runs"]
    assert any("falls back and answers right" in n for n in table.notes)


def test_the_link_side_parts_add_up_to_the_links_gap(tiny):
    """For a fixed level, the last chunk's last byte on the wire minus the simulator's link end is exactly the
    link-side parts (Python overhead, pacing granularity, TCP, trace timing) plus what the simulator's
    per-level chunk size differs from each chunk's real bytes: no part of the gap goes unnamed."""
    model, prep = tiny
    for policy in ("level0", "level3"):
        row = compare.compare(prep, model, SLOW, policy, SLO_S)
        link = sum(row.parts_s[k] for k in ("Python overhead", "pacing granularity", "TCP", "trace timing"))
        link -= sum(c - max(b, r) for (_, b, c, _), (_, _, _, r) in
                    zip(row.measured_spans, [(0, 0, 0, 0)] + row.measured_spans[:-1]))   # compute-side overhead
        sizes = sum(SLOW.transfer_end(start, 8 * len(prep.payloads[policy][i])) - end
                    for i, (start, end, _, _) in enumerate(row.simulated_spans))
        assert row.measured_spans[-1][1] - row.simulated_spans[-1][1] == pytest.approx(link + sizes, abs=1e-9)


def test_a_cancelled_transfer_frees_the_link_for_the_next():
    """Wire.fetch with a give-up time on a link that has stalled: the transfer is cancelled on the socket (the
    bytes that came are the chunk's first ones), and the next transfer starts at once, not after the stalled
    chunk's plan (hundreds of seconds at the stall's rate). The sender paces a chunk from the moment it reads the
    request: on a busy machine that moment may come late, so the link stays fast for half a second (a chunk of
    1 MB takes a second at its rate) before it stalls."""
    payloads = {"a": [bytes(range(256)) * 4096, b"\x07" * 100]}
    stall = st.Trace((0.0, 0.5, 1.2), (0.008, 1e-7, 0.008))       # 8 Mb/s, 100 b/s from 0.5 s to 1.2 s, 8 Mb/s
    with wire.Wire(stall, payloads) as w:
        w.start()
        a = w.fetch(0, "a", give_up_at=0.9)
        assert a.given_up and 0 < len(a.data) < len(payloads["a"][0])
        assert a.data == payloads["a"][0][:len(a.data)] and a.crc_ok
        plan_end = stall.transfer_end(a.asked, 8 * len(payloads["a"][0]))
        b = w.fetch(1, "a")
        assert b.data == payloads["a"][1] and not b.given_up
        assert b.asked < 1.2 < plan_end and b.last_byte < plan_end
        g, end = w.probe(w.now() + 0.03)                           # a probe on the same sender, then a chunk
        assert g > 0 and end >= b.last_byte
        assert w.fetch(1, "a").data == payloads["a"][1]
    assert w.proc.poll() is not None


def test_adaptive_gives_up_a_stalled_chunk_on_the_socket(tiny):
    """The adaptive policy on the socket (streaming.run_adaptive through WireLink): the link stalls after its
    first chunks; the chunk caught in the stall is given up at its deadline (a CANCEL on the socket), recomputed,
    and the run ends long before that chunk would have arrived; every later chunk is recomputed too, and the
    KV answers as the full prefill does."""
    model, prep = tiny
    stall = st.Trace((0.0, 0.1), (0.0008, 0.00001))                # then 10 kb/s: a KV chunk takes seconds
    r = wire_runs.run(prep, model, stall, "adaptive", 0.6)
    k = next(i for i, row in enumerate(r.rows) if row.gave_up)
    row = r.rows[k]
    assert row.choice == "text" and row.abandoned.given_up and row.abandoned.option == row.gave_up
    assert row.arrival.option == "text" and row.arrival.asked >= row.abandoned.last_byte     # then its token ids
    full = stall.transfer_end(row.abandoned.asked, 8 * len(prep.payloads[row.gave_up][k]))
    assert r.ttft_s < full and all(c == "text" for c in r.choices[k:])
    assert r.bytes_equal and r.same_answer and all(x.est_gbps is not None for x in r.rows)


@pytest.mark.parametrize("trace, seconds, gbps", [
    (st.Trace((0.0, 0.3, 3.0), (10.0, 1.0, 5.0)), 1.5, (10 * 0.3 + 1 * 1.2) / 1.5),   # the handout's, SLO 1.5 s
    (st.Trace((0.0, 0.3, 3.0), (10.0, 1.0, 5.0)), 4.0, (10 * 0.3 + 1 * 2.7 + 5 * 1.0) / 4),
    (st.Trace((0.0, 0.3, 3.0), (10.0, 1.0, 5.0)), 0.2, 10.0),
    (st.Trace.steady(25.0), 1.5, 25.0)])
def test_the_layouts_rate_is_the_traces_mean_over_the_slo_window(trace, seconds, gbps):
    assert ws.window_gbps(trace, seconds) == pytest.approx(gbps, rel=1e-12)
    assert ws.window_gbps(wire.scaled(trace, 500.0), seconds) == pytest.approx(gbps / 500, rel=1e-12)


def test_each_levels_layout_is_chosen_by_time_at_the_links_rate(tiny_inputs, monkeypatch):
    """choose_layouts: at a link slow enough that bytes are all that count, each level takes its fewest-bytes
    layout; at one fast enough that decode is all that counts, the fastest-decoding; between, the least of a
    chunk's bytes over the link plus its decode, which flips where the table's tie rate says."""
    _, _, _, specs = tiny_inputs
    monkeypatch.setattr(ks, "layout_decode_s", lambda spec, tokens: dict(DECODE_S))
    fewest = {f"level{s.level}": min(kv.stream_plans(s), key=lambda p: kv.context_bytes(s, 24, p)).layout
              for s in specs}
    assert set(fewest.values()) <= {"group", "K/V"}
    assert {n: c.layout for n, c in measure.choose_layouts(specs, 24, 1e-9).items()} == fewest
    assert {c.layout for c in measure.choose_layouts(specs, 24, 1e6).values()} == {"channel"}
    for name, c in measure.choose_layouts(specs, 24, 0.01).items():
        assert c.layout == c.best_at(c.gbps) and c.gbps == 0.01 and c.decode_s == DECODE_S
        assert c.seconds(c.layout) <= min(c.seconds(x) for x in kv.STREAM_LAYOUTS)
        tie = c.breakeven_gbps(c.runner_up)
        assert {c.best_at(tie * 0.9), c.best_at(tie * 1.1)} == {c.layout, c.runner_up}


class _Measured(Exception):
    """Raised once the context is measured: the test needs its bitstreams, not the runs."""


@pytest.mark.parametrize("gbps", [1e-9, 1e6])
def test_the_wire_codes_its_bitstreams_at_the_traces_rate(tiny_inputs, monkeypatch, gbps):
    """study_of, on a steady trace far too slow or far too fast for the decode to matter: each level's bitstreams,
    as the sender holds them, are in the fewest-bytes layout on the slow link, the fastest-decoding on the fast."""
    model, ids, question, specs = tiny_inputs
    monkeypatch.setattr(ks, "layout_decode_s", lambda spec, tokens: dict(DECODE_S))
    real_prepare, got = measure.prepare, []

    def measured(*args, **kwargs):
        got.append(real_prepare(*args, **kwargs))
        raise _Measured

    monkeypatch.setattr(measure, "prepare", measured)
    with pytest.raises(_Measured):
        ws.study_of(model, ids, question, specs, {"handout": st.Trace.steady(gbps)}, 24, 1.0, SLO_S)
    prep = got[0]
    want = {f"level{s.level}": min(kv.stream_plans(s), key=lambda p: kv.context_bytes(s, 24, p)).layout
            if gbps < 1 else "channel" for s in specs}
    assert prep.layouts == want
    assert {name: {kv.codec_header(b, lengths=False)["layout"] for b in prep.payloads[name]} for name in want} == \
        {name: {lay} for name, lay in want.items()}

"""The adaptive policy's one copy (streaming.run_adaptive) on a clock and link given to it, here a fake one (no
socket): the simulator's link over a trace whose rate stalls, with a compute that may run slower than the setup
predicts, and a margin learned as wire_runs.Learned learns it on the socket (from the compute steps finished by
the time a chunk is decided).

What holds: on a link that stalls mid-chunk, adaptive gives the KV chunk up at its deadline and meets the SLO
that always-text meets (without the give-up it misses); when the compute runs slower than predicted, the
learned margin moves the give-up earlier and adaptive meets an SLO it misses without the margin, and so does
the overhead a slow machine loses per chunk besides its compute; on a compute that runs as predicted, the fake
clock gives exactly the simulator's run."""
from pathlib import Path

import pytest

from lecture27 import streaming as st
from lecture27.stream import simulated
from lecture27.stream import wire_runs

CHUNK = 32                                    # tokens per chunk
L0_BITS = 2e6                                 # a level0 chunk: 2 Mb, 0.1 s at the fast rate
FAST, STALL = 0.02, 0.00002                   # Gb/s: 20 Mb/s, then 20 kb/s (a level0 chunk takes 100 s)
RECOMPUTE_S, DECODE_S = 0.2, 0.1              # predicted per chunk


def setup(chunks: int) -> simulated.MeasuredSetup:
    opts = (st.Option("level0", L0_BITS / CHUNK, 0.95), st.Option("text", 32, 1.0, recompute=True))
    return simulated.MeasuredSetup(model="fake", gpu="fake", n_gpus=1, plan=tuple(st.chunk_plan(chunks * CHUNK, CHUNK)),
                                   options=opts, half_tokens=0.0, recompute=(RECOMPUTE_S,) * chunks,
                                   decode=(("level0", (DECODE_S,) * chunks),))


def stall_at(t: float) -> st.Trace:
    return st.Trace((0.0, t), (FAST, STALL))


class SlowComputeLink(st.SimLink):
    """A fake clock and link: transfers as the trace carries them, every decode and recompute `factor` times
    what the setup predicts. margin(): learned (wire_runs.Learned) from the compute steps finished by the
    time a chunk is decided, or none (learn=False)."""

    def __init__(self, setup, trace, factor: float, learn: bool = True):
        super().__init__(st.Slowed(setup, factor), trace, parallel=True, probe=True)
        self.predicted, self.learn, self.steps, self.t = setup, learn, [], 0.0

    def now(self, link_free):
        self.t = link_free
        return link_free

    def give_up_moment(self, deadline) -> float:
        """The first moment from the decision on at which the deadline, asked with what the run has learned by
        then (a compute step learned when it ends), has come."""
        start, t = self.t, self.t
        readies = sorted(r for _, _, r in self.steps if r > t)
        while True:
            self.t = t
            at = deadline(t)
            later = [r for r in readies if r > t]
            if at <= t or not later or at < later[0]:
                self.t = start
                return max(at, t)
            t = later[0]

    def margin(self):
        learned = wire_runs.Learned()
        for predicted, measured, ready in self.steps:
            if ready <= self.t:
                learned.add(predicted, measured, 0.0)
        return learned.margin() if self.learn else st.Margin()

    def fetch(self, i, chunk, name, t, gpu_free, give_up_at):
        if give_up_at is not None:    # the deadline as it is when the run has learned what it has by then
            give_up_at = (lambda at: lambda now: at)(self.give_up_moment(give_up_at))
        f, measured, gave_up = super().fetch(i, chunk, name, t, gpu_free, give_up_at)
        done = "text" if gave_up else name
        predicted = self.predicted.recompute_s(*chunk) if done == "text" else self.predicted.decode_s(*chunk, done)
        self.steps.append((predicted, f.gpu_s, f.ready))
        return f, measured, gave_up


class HandOver:
    """A setup whose every decode and recompute starts `overhead_s` after its data is in, the compute itself as
    predicted: what a slow machine loses per chunk besides its compute (the hand-over from the link to the
    compute, a request's way to the sender)."""

    def __init__(self, setup, overhead_s: float):
        self.setup, self.overhead_s = setup, overhead_s

    def __getattr__(self, name):
        return getattr(self.setup, name)

    def recompute_s(self, first: int, n: int) -> float:
        return self.setup.recompute_s(first, n) + self.overhead_s

    def decode_s(self, first: int, n: int, name: str) -> float:
        return self.setup.decode_s(first, n, name) + self.overhead_s


class HandOverLink(SlowComputeLink):
    """The fake clock and link on a machine that loses `overhead_s` per chunk, its compute as predicted: margin()
    learns a slowdown of 1 and that overhead (a chunk's lost seconds, as wire_runs.WireLink hands them to
    Learned), from the chunks finished by the time it is asked."""

    def __init__(self, setup, trace, overhead_s: float, learn: bool = True):
        super().__init__(setup, trace, 1.0, learn)
        self.setup, self.overhead_s = HandOver(setup, overhead_s), overhead_s

    def margin(self):
        learned = wire_runs.Learned()
        for predicted, measured, ready in self.steps:
            if ready <= self.t:
                learned.add(predicted, measured - self.overhead_s, self.overhead_s)
        return learned.margin() if self.learn else st.Margin()


def run(s, trace, slo, factor=1.0, learn=True, give_up=True):
    return st.run_adaptive(s, SlowComputeLink(s, trace, factor, learn), slo, FAST, give_up=give_up, parallel=True)


def test_a_stalled_kv_chunk_is_given_up_and_the_slo_met_as_always_text_meets_it():
    s, trace, slo = setup(4), stall_at(0.3), 1.5
    text, level0 = (st.fixed(s, trace, name, parallel=True) for name in ("text", "level0"))
    assert text.ttft_s <= slo < level0.ttft_s              # always text meets it; the stall sinks always level0
    r = run(s, trace, slo)
    assert r.choices == ["level0"] * 3 + ["text"] and r.rows[3]["gave_up"] == "level0"
    # given up once it could no longer be ready by its deadline: the last moment all-text still meets the SLO
    deadline = slo - RECOMPUTE_S - 32 * CHUNK / (st.TEXT_FLOOR_GBPS * st.GBIT)
    ids_in = trace.transfer_end(deadline - DECODE_S, 32 * CHUNK)     # its token ids, sent from then
    assert r.rows[3]["gpu_start"] == pytest.approx(ids_in, abs=1e-9)
    assert r.ttft_s <= slo
    waited = run(s, trace, slo, give_up=False)             # the same policy waiting for every KV chunk
    assert waited.choices == ["level0"] * 4 and waited.ttft_s > slo


def test_the_learned_margin_moves_the_give_up_when_the_compute_is_slower_than_predicted():
    """Every decode and recompute takes 2.5x the prediction. By the time the stalled chunk is decided, chunk 0's
    decode has shown it: the margin puts the deadline where a recompute that slow still meets the SLO."""
    s, trace, slo, factor = setup(6), stall_at(0.5), 2.0, 2.5
    learned, blind = run(s, trace, slo, factor), run(s, trace, slo, factor, learn=False)
    for r in (learned, blind):
        assert r.choices == ["level0"] * 5 + ["text"] and r.rows[5]["gave_up"] == "level0"
    assert learned.rows[5]["gpu_start"] < blind.rows[5]["gpu_start"] - 0.2    # it gives up earlier
    assert learned.ttft_s <= slo < blind.ttft_s
    assert st.adaptive(s, trace, slo, FAST, parallel=True).ttft_s <= slo      # the compute as predicted: in time


@pytest.mark.parametrize("chunks, stall, slo", [(4, 0.2, 1.5), (6, 0.4, 2.1)])
def test_the_learned_overhead_moves_the_give_up_deadlines(chunks, stall, slo):
    """Every chunk loses 0.1 s besides its compute, which runs as predicted. The stalled chunk's give-up deadline
    leaves those 0.1 s for each chunk still to recompute, so adaptive meets the SLO that always-text meets; with
    the deadlines of a machine that loses nothing it gives the chunk up too late and misses. 4 chunks: the
    overhead is learned while the stalled chunk waits (chunk 0's decode ends after it was decided); 6 chunks:
    before it is decided."""
    s, trace = setup(chunks), stall_at(stall)
    link = HandOverLink(s, trace, 0.1)
    assert st.replay(link.setup, trace, ["text"] * chunks, parallel=True).ttft_s <= slo     # always text meets it
    learned = st.run_adaptive(s, link, slo, FAST, parallel=True)
    blind = st.run_adaptive(s, HandOverLink(s, trace, 0.1, learn=False), slo, FAST, parallel=True)
    margin = link.margin()
    assert margin.slowdown == pytest.approx(1.0) and margin.overhead_s == pytest.approx(0.1)
    given_up = [[i for i, row in enumerate(r.rows) if row["gave_up"] == "level0"] for r in (learned, blind)]
    assert given_up[0] == given_up[1] and len(given_up[0]) == 1
    k = given_up[0][0]
    assert learned.rows[k]["gpu_start"] < blind.rows[k]["gpu_start"] - 0.05     # it gives up earlier
    assert learned.ttft_s <= slo < blind.ttft_s


def test_a_compute_as_predicted_is_the_simulators_run():
    """One policy, two clocks: a fake link whose compute runs as predicted learns no margin and gives the
    simulator's run row for row, on a stall and on a steady link."""
    s = setup(4)
    for trace in (stall_at(0.3), st.Trace.steady(FAST), st.Trace((0.0, 0.15, 0.6), (FAST, 0.002, FAST))):
        assert run(s, trace, 1.5).rows == st.adaptive(s, trace, 1.5, FAST, parallel=True).rows


def test_the_learned_margin():
    """wire_runs.Learned: slowdown = the slowest a chunk's compute ran against its prediction, never below 1;
    overhead = the most a chunk lost besides."""
    learned = wire_runs.Learned()
    assert learned.margin() == st.Margin()
    learned.add(0.1, 0.05, 0.0)
    assert learned.margin() == st.Margin(1.0, 0.0)
    learned.add(0.2, 0.3, 0.01)
    learned.add(0.1, 0.12, 0.002)
    m = learned.margin()
    assert m.slowdown == pytest.approx(1.5) and m.overhead_s == pytest.approx(0.01)


TRACES = Path(__file__).resolve().parents[1] / "code" / "lecture27" / "stream" / "traces"


@pytest.mark.parametrize("name", ["collapse", "ramp", "bursts"])
def test_the_held_out_traces_keep_the_promise_in_the_simulator(name):
    """The held-out traces (stream/traces/, for 03's --trace) at Part 5's scale (bandwidths / 500): with these
    chunk sizes and CPU times, adaptive meets the SLO wherever a fixed policy does, on the simulator's clock
    and on a compute 1.5x slower than predicted whose margin it learns."""
    s, slo = setup(4), 1.5
    tr = st.parse_trace((TRACES / f"{name}.csv").read_text())
    trace = st.Trace(tr.times, tuple(g / 500 for g in tr.gbps))
    fixed = {o.name: st.fixed(s, trace, o.name, parallel=True).ttft_s for o in s.options}
    assert any(t <= slo for t in fixed.values())
    assert st.adaptive(s, trace, slo, parallel=True).ttft_s <= slo
    slow = SlowComputeLink(s, trace, 1.5)
    slow_fixed = [st.replay(slow.setup, trace, [o.name] * 4, parallel=True).ttft_s for o in s.options]
    if any(t <= slo for t in slow_fixed):
        assert st.run_adaptive(s, slow, slo, trace.rate_at(0.0), parallel=True).ttft_s <= slo

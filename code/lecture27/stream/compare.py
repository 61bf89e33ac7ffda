"""A run on the wire beside the simulator fed this CPU's times (handout §4.2 on this machine): one trace and
policy run both ways (compare), where the run's seconds went beside the simulator's (parts), and the cause
of a TTFT gap above GAP_SHARE (cause)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lecture27 import streaming as st
from lecture27 import wire
from lecture27.stream import answer
from lecture27.stream import simulated
from lecture27.stream import wire_runs

GAP_SHARE = 0.10          # measured and simulated TTFT "differ" above this share of the measured


def parts(m: wire_runs.WireRun, prep, trace: st.Trace, sim: st.Result | None = None) -> dict:
    """Where the run's seconds went beside the simulator's, summed over chunks (positive: the wire was
    slower): decode and recompute time (measured in the run against the times the simulator was fed),
    pacing granularity (the sender's last write after its plan), TCP (the request's way to the sender and
    the bytes' way back), Python overhead (the link thread's decision, the hand-over to the compute thread),
    and, given the simulated run `sim` with the same choices, the trace's timing: a chunk asked for a few ms
    later than simulated meets another stretch of the trace, and across a drop in bandwidth those ms cost
    the rest of the chunk's bytes at the slower rate (the trace's time for the chunk's bytes from the
    measured start against that from the simulated start). prep: the measured context (measure.Prepared)."""
    setup = simulated.measured_setup(prep)
    out = dict.fromkeys(("decode time", "recompute time", "pacing granularity", "TCP", "Python overhead",
                         "trace timing"), 0.0)
    prev_byte, prev_ready = 0.0, 0.0
    srows = sim.rows if sim is not None and sim.choices == m.choices else [None] * len(m.rows)
    for (first, n), r, sr in zip(prep.plan, m.rows, srows):
        a, opt = r.arrival, setup.option(r.choice)
        if opt.recompute or r.why is not None:
            out["recompute time"] += r.compute_s - setup.recompute_s(first, n)
        else:
            out["decode time"] += r.compute_s - setup.decode_s(first, n, opt.name)
        if r.abandoned is not None:          # a transfer the policy gave up: its link seconds were lost on purpose
            out["Python overhead"] += r.abandoned.asked - prev_byte
            prev_byte = r.abandoned.last_byte
        if a is not None:
            bits = 8 * len(a.data)
            out["TCP"] += (a.planned - trace.transfer_end(a.asked, bits)) + (a.last_byte - a.sent)
            out["pacing granularity"] += a.sent - a.planned
            out["Python overhead"] += a.asked - prev_byte
            if sr is not None:   # the same bits from the measured start and from the simulated one
                out["trace timing"] += ((trace.transfer_end(a.asked, bits) - a.asked)
                                        - (trace.transfer_end(sr["start"], bits) - sr["start"]))
            prev_byte = a.last_byte
        out["Python overhead"] += r.compute_start - max(prev_byte, prev_ready)
        prev_ready = r.ready
    return out


def cause(m: wire_runs.WireRun, s: st.Result, p: dict) -> str | None:
    """None when measured and simulated TTFT are within GAP_SHARE; else what differs: the choices (the
    socket measured another throughput than the trace's), or the part of the run's parts() `p` that cost
    most."""
    if abs(m.ttft_s - s.ttft_s) <= GAP_SHARE * m.ttft_s:
        return None
    if m.choices != s.choices:
        return "choices (the throughput measured on the socket)"
    sign = 1.0 if m.ttft_s > s.ttft_s else -1.0
    return max(p, key=lambda k: sign * p[k])


@dataclass(frozen=True, kw_only=True)
class Compared:
    """One trace and policy measured on the wire and simulated with this CPU's times. The first six fields
    are the spec's wire_runs entry (entry()); then the answer's check, the cause of a TTFT gap above
    GAP_SHARE (None within it), the measured parts (parts()) and both timelines, per chunk (link start,
    link end, compute start, ready) seconds (the link's None for a chunk the wire did not carry); per chunk the
    level given up on the socket (None where none was), the adaptive run's probes and learned margin."""
    measured_ttft_s: float
    simulated_ttft_s: float
    measured_choices: list
    simulated_choices: list
    measured_slo_met: bool
    simulated_slo_met: bool
    first_token_kl: float
    same_answer: bool
    bytes_equal: bool
    cause: str | None
    parts_s: dict
    measured_ready_s: list
    simulated_ready_s: list
    measured_spans: list
    simulated_spans: list
    gave_up: list = dataclasses.field(default_factory=list)
    probes: int = 0
    margin: st.Margin | None = None

    ENTRY = ("measured_ttft_s", "simulated_ttft_s", "measured_choices", "simulated_choices", "measured_slo_met",
             "simulated_slo_met")

    def entry(self) -> dict:
        return {k: getattr(self, k) for k in self.ENTRY}


def compare(prep, model, trace: st.Trace, policy: str, slo_s: float, w: wire.Wire | None = None,
            check: answer.AnswerCheck | None = None) -> Compared:
    """Run `policy` on the wire paced to `trace` (already scaled) and in the simulator, side by side (prep,
    w, check: as wire_runs.run takes them)."""
    m = wire_runs.run(prep, model, trace, policy, slo_s, w=w, check=check)
    s = simulated.simulate(prep, trace, policy, slo_s)
    p = parts(m, prep, trace, s)
    links = [(None, None) if r.arrival is None else ((r.abandoned or r.arrival).asked, r.arrival.last_byte)
             for r in m.rows]             # a chunk given up: from its cancelled transfer to its token ids' last byte
    return Compared(measured_ttft_s=m.ttft_s, simulated_ttft_s=s.ttft_s, measured_choices=m.choices,
                    simulated_choices=s.choices, measured_slo_met=m.slo_met,
                    simulated_slo_met=s.ttft_s <= slo_s + 1e-12, first_token_kl=m.first_token_kl,
                    same_answer=m.same_answer, bytes_equal=m.bytes_equal, cause=cause(m, s, p), parts_s=p,
                    measured_ready_s=[r.ready for r in m.rows], simulated_ready_s=[r["finish"] for r in s.rows],
                    measured_spans=[link + (r.compute_start, r.ready) for link, r in zip(links, m.rows)],
                    simulated_spans=[(r["start"], r["link_end"], r["gpu_start"], r["finish"]) for r in s.rows],
                    gave_up=[r.gave_up for r in m.rows], probes=m.probes, margin=m.margin)

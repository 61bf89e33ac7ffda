"""CacheGen's streaming policy over a real connection (handout §4.2, wire.py's paced socket): one context
streamed through a Wire, then the answer its KV gives checked (answer.AnswerCheck).

Two threads work at once, as the simulator's parallel model says: the link thread decides each chunk as soon
as the previous one's last byte is in and asks the sender for it; the compute thread puts each chunk's KV
after the KV so far, in order (chunk_kv: a KV chunk decoded once its bytes are in, a text chunk recomputed).
The adaptive policy is the simulator's, the same code (streaming.run_adaptive), on the socket's clock
(WireLink): the throughput the socket measured on the previous KV chunk (or a probe's), each chunk's token
share of the time left as its budget, the compute thread's predicted backlog as a text chunk's wait, the
probe of the idle link while text waits for the compute thread, and the give-up deadline, at which a KV chunk
not in is cancelled on the socket and recomputed. Its margin is learned in the run (Learned): how much slower
than measured alone the compute thread has been, and what a chunk lost besides (the hand-over between the
threads, a text chunk's request). Faults never build a wrong KV: a chunk whose bytes fail their CRC or do not
decode (CorruptStream) is recomputed; once the sender is gone (WireTimeout) every chunk left is recomputed
from the request's own text.
"""
from __future__ import annotations

import dataclasses
import math
import queue
import threading
from dataclasses import dataclass, field

from lecture27 import streaming as st
from lecture27 import wire
from lecture27.coder import CorruptStream
from lecture27.stream import answer
from lecture27.stream import chunk_kv
from lecture27.stream import simulated
from common.llama import KVCache

COMPUTE_WAIT_S = 600.0    # the compute thread waits at most this long for the link thread's next chunk


@dataclass(frozen=True)
class Fetched:
    """What the link thread did for one chunk: its choice (text for a chunk given up), why the sender counts
    as lost (None while it serves), the chunk's wire.Arrival (None for a chunk the wire did not carry), the
    level given up (None when none was) and the Arrival of its cancelled transfer."""
    chunk: int
    choice: str
    lost: str | None
    arrival: wire.Arrival | None
    gave_up: str | None = None
    abandoned: wire.Arrival | None = None


@dataclass(frozen=True, kw_only=True)
class WireChunk:
    """One chunk of a run on the wire: the link side (Fetched's choice, lost, arrival: the asked, last_byte,
    planned and sent times are the arrival's; gave_up), then the compute side: when the compute thread
    started on it, when its KV was ready, the seconds between, and why it was recomputed instead of its
    choice (None when it was not); est_gbps: the throughput the adaptive policy assumed (None for a fixed
    policy); abandoned: the Arrival of a transfer given up (its arrival is then the token ids')."""
    choice: str
    lost: str | None
    arrival: wire.Arrival | None
    compute_start: float
    ready: float
    compute_s: float
    why: str | None
    gave_up: str | None = None
    est_gbps: float | None = None
    abandoned: wire.Arrival | None = None


@dataclass(kw_only=True)
class WireRun:
    """One context streamed over the wire: its policy and SLO, a WireChunk per chunk, the TTFT (the last
    chunk's KV ready), the answer's check against the full prefill's, and the faults met; the adaptive
    policy's probes and the margin it had learned by the end of the run (None for a fixed policy)."""
    policy: str
    slo_s: float
    rows: list = field(default_factory=list)
    ttft_s: float = 0.0
    first_token_kl: float = math.nan
    same_answer: bool = False
    bytes_equal: bool = True          # every chunk received is byte for byte the one the sender holds
    fell_back: bool = False           # the sender was lost and the chunks left were recomputed
    probes: int = 0
    margin: st.Margin | None = None

    @property
    def choices(self) -> list:
        return [r.choice for r in self.rows]

    @property
    def slo_met(self) -> bool:
        return self.ttft_s <= self.slo_s + 1e-12


class Learned:
    """The margin the policy learns within a run: each chunk's compute as the compute thread measured it,
    against its predicted seconds (the times measured alone before the runs), and what the chunk lost besides
    (the hand-over from the link thread; a text chunk's request for its token ids, a KV chunk's last byte
    past its plan: TCP and pacing). The compute thread adds,
    the link thread reads (a list: appends and copies are atomic)."""

    def __init__(self):
        self.steps = []          # (predicted s, measured s, lost s) per chunk computed

    def add(self, predicted_s: float, measured_s: float, lost_s: float) -> None:
        self.steps.append((predicted_s, measured_s, lost_s))

    def margin(self) -> st.Margin:
        """streaming.Margin: slowdown = the slowest a chunk's compute has run against its prediction (at least
        1: a few chunks are all the run has, and the chunk a give-up leaves to the end must not run slower than
        the margin says); overhead_s = the most a chunk has lost besides (hand-over, request, TCP, pacing)."""
        steps = list(self.steps)
        if not steps:
            return st.Margin()
        return st.Margin(max(1.0, max(m / p for p, m, _ in steps)), max(lost for _, _, lost in steps))


class WireLink:
    """The socket's clock and link for streaming.run_adaptive (streaming.SimLink's interface): a chunk is
    decided at the socket's now; fetched over the Wire (a give-up deadline cancels its transfer once it can
    no longer be ready in time) and handed to the compute thread; a probe is wire.Wire.probe until the
    compute thread is predicted free. The Transfer it returns is what the link thread knows: the link's real
    times, the compute predicted (slowed by the margin). Once the sender is lost every chunk is text."""

    def __init__(self, w: wire.Wire, setup: simulated.MeasuredSetup, jobs: queue.Queue, learned: Learned):
        self.w, self.setup, self.jobs, self.learned, self.lost = w, setup, jobs, learned, None

    def now(self, link_free: float) -> float:
        return self.w.now()

    def margin(self) -> st.Margin:
        return self.learned.margin()

    def probe(self, t: float, gpu_free: float) -> tuple[float, float]:
        if self.lost is None:
            try:
                return self.w.probe(gpu_free)
            except wire.WireTimeout as e:
                self.lost = str(e)
        return 0.0, max(self.w.now(), gpu_free)

    def fetch(self, i: int, chunk: tuple, name: str, t: float, gpu_free: float, give_up_at: float | None):
        def cancel_at() -> float:          # the bytes must be in by then for the chunk to be ready by its deadline
            return give_up_at(self.w.now()) - st.Slowed(self.setup, self.margin().slowdown).decode_s(*chunk, name)

        arrival, gave_up, measured, abandoned = self._fetch(i, name, give_up_at and cancel_at), None, None, None
        pred = st.Slowed(self.setup, self.margin().slowdown)
        if arrival is None:
            name = "text"
        elif not self.setup.option(name).recompute:
            # the throughput its bytes measured; a transfer given up before its first write measures at most a
            # byte over its seconds (never 0, which would leave the policy no fastest option)
            measured = 8 * max(len(arrival.data), 1) / max(arrival.last_byte - arrival.asked, 1e-9) / st.GBIT
            if arrival.given_up or (give_up_at is not None and
                                    max(arrival.last_byte, gpu_free) + pred.decode_s(*chunk, name) >
                                    give_up_at(arrival.last_byte)):
                gave_up, name, abandoned = name, "text", arrival   # it cannot be ready by its deadline:
                arrival = self._fetch(i, name, None)                 # recompute it, its token ids fetched
        link_end = self.w.now() if arrival is None else arrival.last_byte
        gpu_start = max(link_end, gpu_free)
        gpu_s = pred.recompute_s(*chunk) if name == "text" else pred.decode_s(*chunk, name)
        self.jobs.put(Fetched(i, name, self.lost, arrival, gave_up, abandoned))
        start = t if abandoned is None and arrival is None else (abandoned or arrival).asked
        return st.Transfer(start, link_end, gpu_start, gpu_s, gpu_start + gpu_s), measured, gave_up

    def _fetch(self, i: int, name: str, give_up_at) -> wire.Arrival | None:
        """The chunk over the Wire, or None once the sender is lost (then for good)."""
        if self.lost is None:
            try:
                return self.w.fetch(i, name, give_up_at)
            except wire.WireTimeout as e:
                self.lost = str(e)
        return None


def run(prep, model, trace: st.Trace, policy: str, slo_s: float, faults: wire.Faults = wire.Faults(),
        margin_s: float = wire.MARGIN_S, w: wire.Wire | None = None,
        check: answer.AnswerCheck | None = None) -> WireRun:
    """Stream prep's context (a measure.Prepared) over a Wire paced to `trace` (already scaled) with `policy`
    ("adaptive" or an option's name, always that one); then the answer, against the full prefill's. w: a
    Wire of prep's payloads to run on (its sender serves run after run; faults and margin_s are then the
    Wire's); default: a Wire of its own. check: the AnswerCheck to use (default: a new one)."""
    if w is None:
        with wire.Wire(trace, prep.payloads, margin_s=margin_s, faults=faults) as own:
            return run(prep, model, trace, policy, slo_s, w=own, check=check)
    setup = simulated.measured_setup(prep)
    res = WireRun(policy=policy, slo_s=slo_s)
    jobs: queue.Queue = queue.Queue()
    learned, decided = Learned(), []
    w.start(trace)
    link = threading.Thread(target=_link, args=(WireLink(w, setup, jobs, learned), setup, policy, slo_s, trace,
                                                decided, jobs), daemon=True)
    link.start()
    try:
        cache = _compute(w, prep, model, res, jobs, setup, learned)
    finally:
        link.join(COMPUTE_WAIT_S)
    if decided:                  # the adaptive policy's own rows: the throughput it assumed per chunk
        res.rows = [dataclasses.replace(r, est_gbps=d["est_gbps"]) for r, d in zip(res.rows, decided[0].rows)]
        res.probes, res.margin = sum(d["probe"] for d in decided[0].rows), learned.margin()
    res.ttft_s = max(r.ready for r in res.rows)
    res.first_token_kl, res.same_answer = (check or answer.AnswerCheck(prep, model))(cache)
    return res


def _link(link: WireLink, setup: simulated.MeasuredSetup, policy: str, slo_s: float, trace: st.Trace,
          decided: list, jobs: queue.Queue) -> None:
    """The link thread: the adaptive policy (streaming.run_adaptive on the socket's clock; its Result put in
    `decided`), or a fixed one, each chunk fetched when the link is free and handed to the compute thread
    (an exception is handed over too, so the compute thread never waits forever)."""
    try:
        if policy == "adaptive":
            decided.append(st.run_adaptive(setup, link, slo_s, trace.rate_at(0.0), parallel=True))
            return
        gpu_free = 0.0
        for i, chunk in enumerate(setup.plan):
            f, _, _ = link.fetch(i, chunk, policy, link.now(0.0), gpu_free, None)
            gpu_free = f.ready
    except BaseException as e:   # noqa: BLE001 -- handed to the compute thread, which raises it
        jobs.put(e)


def _compute(w: wire.Wire, prep, model, res: WireRun, jobs: queue.Queue, setup: simulated.MeasuredSetup,
             learned: Learned) -> KVCache:
    """The compute thread: each chunk in order, decoded or recomputed onto the KV so far, its WireChunk added
    to res and its time to `learned`. A KV chunk is used only if its bytes pass their CRC and decode;
    otherwise it is recomputed (never a wrong KV)."""
    cache, n_kv, prev_ready = None, model.cfg.n_kv_heads, 0.0
    for _ in prep.plan:
        job = jobs.get(timeout=COMPUTE_WAIT_S)
        if isinstance(job, BaseException):
            raise job
        i, name, arrival = job.chunk, job.choice, job.arrival
        first, n = prep.plan[i]
        t0, why = w.now(), None
        for a in (x for x in (job.abandoned, arrival) if x is not None):   # one given up: its first bytes
            sent = prep.payloads[a.option][i]
            res.bytes_equal &= a.data == (sent[:len(a.data)] if a.given_up else sent)
        if arrival is not None and name != "text":
            try:
                if not arrival.crc_ok:
                    raise CorruptStream(f"chunk {i}: its bytes fail their CRC")
                _, cache = chunk_kv.decode_onto(cache, arrival.data, prep.specs[int(name.removeprefix("level"))],
                                                n_kv, first, n)
            except (CorruptStream, ValueError) as e:
                why = f"recomputed: {e}"
        if arrival is None or name == "text" or why is not None:
            cache = chunk_kv.recompute_onto(model, cache, prep.ids, first, n)
        ready = w.now()
        res.rows.append(WireChunk(choice=name, lost=job.lost, arrival=arrival, compute_start=t0, ready=ready,
                                  compute_s=ready - t0, why=why, gave_up=job.gave_up, abandoned=job.abandoned))
        text = name == "text" or why is not None
        predicted = setup.recompute_s(first, n) if text else setup.decode_s(first, n, name)
        came = t0 if arrival is None else arrival.last_byte
        # what the link lost besides: a text chunk's request for its token ids, a KV chunk's last byte past
        # the token bucket's plan (TCP, pacing)
        link = 0.0 if arrival is None else (arrival.last_byte - arrival.asked if arrival.option == "text"
                                            else max(0.0, arrival.last_byte - arrival.planned))
        learned.add(predicted, ready - t0, max(0.0, t0 - max(came, prev_ready)) + link)
        prev_ready = ready
        res.fell_back |= job.lost is not None
    return cache

"""CacheGen's streaming policy over a real connection (handout §4.2, wire.py's paced socket): one context
streamed through a Wire, then the answer its KV gives checked (answer.AnswerCheck).

Two threads work at once, as the simulator's parallel model says: the link thread decides each chunk as soon
as the previous one's last byte is in and asks the sender for it; the compute thread puts each chunk's KV
after the KV so far, in order (chunk_kv: a KV chunk decoded once its bytes are in, a text chunk recomputed).
The adaptive policy is streaming's rule (streaming.choose) on the throughput the socket measured on the
previous KV chunk, each chunk's token share of the time left as its budget, and the compute thread's
predicted backlog as a text chunk's wait; it runs without the probe and the give-up deadline
(streaming.adaptive(probe=False, give_up=False)). Faults never build a wrong KV: a chunk whose bytes fail
their CRC or do not decode (CorruptStream) is recomputed; once the sender is gone (WireTimeout) every chunk
left is recomputed from the request's own text.
"""
from __future__ import annotations

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
    """What the link thread did for one chunk: its choice, the throughput the policy assumed (None for a
    fixed policy), why the sender counts as lost (None while it serves) and the chunk's wire.Arrival (None
    for a chunk the wire did not carry)."""
    chunk: int
    choice: str
    est_gbps: float | None
    lost: str | None
    arrival: wire.Arrival | None


@dataclass(frozen=True, kw_only=True)
class WireChunk:
    """One chunk of a run on the wire: the link side (Fetched's choice, est_gbps, lost, arrival: the asked,
    last_byte, planned and sent times are the arrival's), then the compute side: when the compute thread
    started on it, when its KV was ready, the seconds between, and why it was recomputed instead of its
    choice (None when it was not)."""
    choice: str
    est_gbps: float | None
    lost: str | None
    arrival: wire.Arrival | None
    compute_start: float
    ready: float
    compute_s: float
    why: str | None


@dataclass(kw_only=True)
class WireRun:
    """One context streamed over the wire: its policy and SLO, a WireChunk per chunk, the TTFT (the last
    chunk's KV ready), the answer's check against the full prefill's, and the faults met."""
    policy: str
    slo_s: float
    rows: list = field(default_factory=list)
    ttft_s: float = 0.0
    first_token_kl: float = math.nan
    same_answer: bool = False
    bytes_equal: bool = True          # every chunk received is byte for byte the one the sender holds
    fell_back: bool = False           # the sender was lost and the chunks left were recomputed

    @property
    def choices(self) -> list:
        return [r.choice for r in self.rows]

    @property
    def slo_met(self) -> bool:
        return self.ttft_s <= self.slo_s + 1e-12


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
    w.start(trace)
    link = threading.Thread(target=_link, args=(w, setup, prep, policy, slo_s, trace, jobs), daemon=True)
    link.start()
    try:
        cache = _compute(w, prep, model, res, jobs)
    finally:
        link.join(COMPUTE_WAIT_S)
    res.ttft_s = max(r.ready for r in res.rows)
    res.first_token_kl, res.same_answer = (check or answer.AnswerCheck(prep, model))(cache)
    return res


def _link(w: wire.Wire, setup: simulated.MeasuredSetup, prep, policy: str, slo_s: float, trace: st.Trace,
          jobs: queue.Queue) -> None:
    """The link thread: decide each chunk when the link is free, fetch it, hand it to the compute thread as
    a Fetched (an exception is handed over too, so the compute thread never waits forever)."""
    try:
        est, gpu_free, left, lost = trace.rate_at(0.0), 0.0, setup.context_tokens, None
        for i, chunk in enumerate(prep.plan):
            t = w.now()
            name, est_used = policy, None
            if lost is not None:
                name = "text"
            elif policy == "adaptive":
                budget = max(0.0, slo_s - t) * chunk[1] / left
                name, _ = st.choose(setup, chunk, est, budget, None, max(0.0, gpu_free - t))
                est_used = est
            arrival = None
            if lost is None:
                try:
                    arrival = w.fetch(i, name)
                except wire.WireTimeout as e:
                    lost, name = str(e), "text"
            if arrival is not None and not setup.option(name).recompute:
                est = arrival.gbps
            done = w.now() if arrival is None else arrival.last_byte
            gpu_free = max(done, gpu_free) + (setup.recompute_s(*chunk) if setup.option(name).recompute
                                              else setup.decode_s(*chunk, name))
            left -= chunk[1]
            jobs.put(Fetched(i, name, est_used, lost, arrival))
    except BaseException as e:   # noqa: BLE001 -- handed to the compute thread, which raises it
        jobs.put(e)


def _compute(w: wire.Wire, prep, model, res: WireRun, jobs: queue.Queue) -> KVCache:
    """The compute thread: each chunk in order, decoded or recomputed onto the KV so far, its WireChunk added
    to res. A KV chunk is used only if its bytes pass their CRC and decode; otherwise it is recomputed
    (never a wrong KV)."""
    cache, n_kv = None, model.cfg.n_kv_heads
    for _ in prep.plan:
        job = jobs.get(timeout=COMPUTE_WAIT_S)
        if isinstance(job, BaseException):
            raise job
        i, name, arrival = job.chunk, job.choice, job.arrival
        first, n = prep.plan[i]
        t0, why = w.now(), None
        if arrival is not None:
            res.bytes_equal &= arrival.data == prep.payloads[name][i]
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
        res.rows.append(WireChunk(choice=name, est_gbps=job.est_gbps, lost=job.lost, arrival=arrival,
                                  compute_start=t0, ready=ready, compute_s=ready - t0, why=why))
        res.fell_back |= job.lost is not None
    return cache

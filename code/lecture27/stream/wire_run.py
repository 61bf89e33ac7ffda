"""CacheGen's streaming policy over a real connection (handout §4.2, wire.py's paced socket), beside the
simulator fed this CPU's own times.

prepare() measures a context once on this CPU: each chunk's recompute (the model's prefill of that chunk
after the exact KV of the chunks before it), its bitstream at every codec level (the sender's payloads,
in LAYOUT) and each bitstream's decode (put after the KV before it, as a run does), and the full prefill's
answer (the first token's distribution, the greedy tokens). measured_setup() turns those times into a
streaming.Setup, so that the simulator runs with them.

run() streams the context through a Wire (its own, or one whose sender serves run after run), then checks
the answer its KV gives (AnswerCheck: once per distinct KV). Two threads work at once, as the simulator's parallel model
says: the link thread decides each chunk as soon as the previous one's last byte is in and asks the
sender for it; the compute thread decodes each KV chunk once its bytes are in (kvcache.codec_decode), or
recomputes a text chunk after the chunks before it, in order. The adaptive policy is streaming's rule
(streaming.choose) on the throughput the socket measured on the previous KV chunk, each chunk's token
share of the time left as its budget, and the compute thread's predicted backlog as a text chunk's wait;
it runs without the probe and the give-up deadline (streaming.adaptive(probe=False, give_up=False)).
Faults never build a wrong KV: a chunk whose bytes fail their CRC or do not decode (CorruptStream) is
recomputed; once the sender is gone (WireTimeout) every chunk left is recomputed from the request's own text.

compare() runs one trace and policy on the wire and in the simulator and names the cause of a TTFT gap
above GAP_SHARE from the measured parts of the run.
"""
from __future__ import annotations

import hashlib
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from lecture27 import kvcache as kv
from lecture27 import streaming as st
from lecture27 import wire
from lecture27.coder import CorruptStream
from common.llama import KVCache, kl_divergence
from common.llama import array_to_kv, kv_to_array
from common.llama import greedy

GAP_SHARE = 0.10          # measured and simulated TTFT "differ" above this share of the measured
LAYOUT = "channel"        # one stream per (layer, K/V, channel) of a group, as CacheGen's GPU decoder runs them:
                          # numpy's parallel decoder is fast only with many streams (a short chunk in the
                          # codec's own choice of layout is a few streams, decoded 10x slower)
ANSWER_TOKENS = 8         # greedy tokens compared with the full prefill's
COMPUTE_WAIT_S = 600.0    # the compute thread waits at most this long for the link thread's next chunk


@dataclass(frozen=True)
class Prepared:
    """A context measured on this CPU; everything a run needs besides the trace and the policy."""
    plan: tuple               # (first token, tokens) per chunk
    ids: tuple                # the context's token ids
    question: tuple           # token ids read after the context: the answer's first token follows them
    specs: tuple              # the codec's CodecSpecs, finest level first
    options: tuple            # streaming.Options: the levels (bits per token as coded), text last
    payloads: dict            # option name -> bytes per chunk ("text": the token ids as int32)
    recompute_s: tuple        # measured seconds per chunk
    decode_s: dict            # level name -> measured seconds per chunk
    ref_logp: torch.Tensor    # the full prefill's first-answer-token log-probabilities (vocab,)
    ref_answer: tuple         # the full prefill's greedy tokens


def _greedy(model, cache: KVCache, question: tuple, n: int):
    """(log-probs of the first answer token, n greedy tokens) after `question` attends to `cache`."""
    with torch.no_grad():
        logits, cache = model(torch.tensor([question]), cache=cache, last=True)
    return logits[0, -1].float().log_softmax(-1), tuple(greedy(model, logits[:, -1], cache, n)[0])


def prepare(model, ids, question, chunk_tokens: int, specs, accuracy: dict | None = None,
            answer_tokens: int = ANSWER_TOKENS, layout: str | None = LAYOUT, keep_streams: bool = False) -> Prepared:
    """Measure a context on this CPU (see the module's docstring). accuracy: level -> the answer accuracy
    a chunk at that level counts for (the policy's quality; default 1 for every level); layout: the
    bitstreams' (None: the codec's own choice, kvcache.stream_plan); keep_streams: the bitstreams kept in
    the checkpoint folder, under the quantized KV they code (a bitstream is no timing: every time is
    measured in this call, and every bitstream decoded and checked bit for bit)."""
    plan = tuple(st.chunk_plan(len(ids), chunk_tokens))
    cache, recompute = None, []
    with torch.no_grad():
        model(torch.tensor([ids[:plan[0][1]]]), last=True)   # untimed: a model's first forward allocates its buffers
        for first, n in plan:
            t = time.perf_counter()
            _, cache = model(torch.tensor([ids[first:first + n]]), cache=cache, last=True)
            recompute.append(time.perf_counter() - t)
    X = kv_to_array(cache)[0]
    payloads, decode_s, options = {}, {}, []
    for spec in specs:
        name = f"level{spec.level}"
        payloads[name] = _encode(X, plan, spec, layout, keep_streams)
        decode_s[name] = []
        kv.codec_decode(payloads[name][0], specs, groups=[0])  # untimed: a spec's first decode builds its tables
        for (f, n), data in zip(plan, payloads[name]):
            before = _head(cache, f)
            t = time.perf_counter()              # the compute thread's work for a KV chunk, as _compute does it
            q, _ = _decode_onto(before, data, spec, model.cfg.n_kv_heads, f, n)
            decode_s[name].append(time.perf_counter() - t)
            assert np.array_equal(q, kv.quantize(X[f:f + n], spec)), "a bitstream did not decode bit for bit"
        bits = 8 * sum(map(len, payloads[name])) / len(ids)
        options.append(st.Option(name, bits, 1.0 if accuracy is None else accuracy[spec.level],
                                 bits_per_value=bits / X[0].size))
    payloads["text"] = [np.asarray(ids[f:f + n], np.int32).tobytes() for f, n in plan]
    options.append(st.Option("text", 8 * st.TEXT_BYTES_PER_TOKEN, 1.0, recompute=True))
    ref_logp, ref_answer = _greedy(model, cache, tuple(question), answer_tokens)
    return Prepared(plan, tuple(ids), tuple(question), tuple(specs), tuple(options), payloads, tuple(recompute),
                    {k: tuple(v) for k, v in decode_s.items()}, ref_logp, ref_answer)


def _head(cache: KVCache, n: int) -> KVCache | None:
    """The cache's first n tokens (None for none)."""
    if n == 0:
        return None
    return KVCache([k[:, :, :n] for k in cache.k], [v[:, :, :n] for v in cache.v], cache.pos[:n])


def _decode_onto(cache: KVCache | None, data: bytes, spec, n_kv: int, first: int, n: int):
    """A KV chunk's bitstream decoded (raises CorruptStream or ValueError) and its KV put after `cache`:
    (the quantized integers, the cache with the chunk)."""
    q = kv.codec_decode(data, spec)
    part = array_to_kv(kv.dequantize(q, spec), n_kv, pos=torch.arange(first, first + n))
    return q, part if cache is None else KVCache.cat([cache, part])


def _encode(X, plan, spec, layout, keep: bool) -> list:
    """Each chunk's bitstream; the chunks of one length coded side by side (kvcache.codec_encode_many);
    keep: cached under a digest of the quantized chunks, the spec and the layout (common.checkpoints)."""
    from common.checkpoints import cached

    def compute():
        out = {}
        for n in {n for _, n in plan}:
            firsts = [f for f, m in plan if m == n]
            out |= dict(zip(firsts, kv.codec_encode_many(np.stack([X[f:f + n] for f in firsts]), spec, layout)))
        return {"streams": [torch.frombuffer(bytearray(out[f]), dtype=torch.uint8) for f, _ in plan]}

    digest = hashlib.sha256()
    for f, n in plan:
        digest.update(np.ascontiguousarray(kv.quantize(X[f:f + n], spec)).tobytes())
    ident = {"symbols": digest.hexdigest(), "spec": spec.fingerprint, "layout": layout, "plan": plan}
    return cached("wire-streams", ident, compute, use=lambda d, _: [t.numpy().tobytes() for t in d["streams"]],
                  tag="wire", store=keep)


@dataclass(frozen=True)
class MeasuredSetup(st.Setup):
    """A streaming.Setup whose recompute and decode times are the ones measured on this CPU."""
    recompute: tuple = ()     # seconds per chunk
    decode: tuple = ()        # ((level name, seconds per chunk), ...)

    def _index(self, first: int) -> int:
        return next(i for i, (f, _) in enumerate(self.plan) if f == first)

    def recompute_s(self, first: int, n: int) -> float:
        return self.recompute[self._index(first)]

    def decode_s(self, first: int, n: int, name: str) -> float:
        return dict(self.decode)[name][self._index(first)]


def measured_setup(prep: Prepared) -> MeasuredSetup:
    return MeasuredSetup("measured", "this CPU", 1, prep.plan, prep.options, 0.0, prep.recompute_s,
                         tuple(prep.decode_s.items()))


@dataclass
class WireRun:
    """One context streamed over the wire. Per chunk (rows): choice, est_gbps (what the policy assumed),
    asked / last_byte / planned / sent (wire.Arrival's times; None for a chunk the wire did not carry),
    compute_start, ready, compute_s, and `why` when it was recomputed instead of its choice."""
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
        return [r["choice"] for r in self.rows]

    @property
    def slo_met(self) -> bool:
        return self.ttft_s <= self.slo_s + 1e-12


class AnswerCheck:
    """The answer a run's KV gives, against the full prefill's: (first token's KL, same greedy tokens). The
    answer is a function of the KV's bits, so a KV equal bit for bit to one already checked (the same
    choices decode and recompute to the same values) gives that one's answer: computed once per KV."""

    def __init__(self, prep: Prepared, model):
        self.prep, self.model, self.seen = prep, model, {}
        self.computed = self.reused = 0
        self.seconds = 0.0                # spent answering

    def __call__(self, cache: KVCache) -> tuple[float, bool]:
        h = hashlib.sha256()
        for t in (*cache.k, *cache.v, *[cache.pos] * (cache.pos is not None)):
            h.update(t.contiguous().numpy().tobytes())
        key = h.hexdigest()
        if key in self.seen:
            self.reused += 1
            return self.seen[key]
        t = time.perf_counter()
        first, answer = _greedy(self.model, cache, self.prep.question, len(self.prep.ref_answer))
        self.seconds += time.perf_counter() - t
        self.computed += 1
        self.seen[key] = float(kl_divergence(self.prep.ref_logp, first)), answer == self.prep.ref_answer
        return self.seen[key]


def run(prep: Prepared, model, trace: st.Trace, policy: str, slo_s: float, faults: wire.Faults = wire.Faults(),
        timeout_s: float = wire.TIMEOUT_S, w: wire.Wire | None = None, check: AnswerCheck | None = None) -> WireRun:
    """Stream prep's context over a Wire paced to `trace` (already scaled) with `policy` ("adaptive" or an
    option's name, always that one); then the answer, against the full prefill's. w: a Wire of prep's
    payloads to run on (its sender serves run after run; faults and timeout_s are then the Wire's);
    default: a Wire of its own. check: the AnswerCheck to use (default: a new one)."""
    if w is None:
        with wire.Wire(trace, prep.payloads, timeout_s=timeout_s, faults=faults) as own:
            return run(prep, model, trace, policy, slo_s, w=own, check=check)
    setup = measured_setup(prep)
    res = WireRun(policy, slo_s, [dict() for _ in prep.plan])
    jobs: queue.Queue = queue.Queue()
    w.start(trace)
    link = threading.Thread(target=_link, args=(w, setup, prep, policy, slo_s, trace, res, jobs), daemon=True)
    link.start()
    try:
        cache = _compute(w, prep, model, res, jobs)
    finally:
        link.join(COMPUTE_WAIT_S)
    res.ttft_s = max(r["ready"] for r in res.rows)
    res.first_token_kl, res.same_answer = (check or AnswerCheck(prep, model))(cache)
    return res


def _link(w: wire.Wire, setup: MeasuredSetup, prep: Prepared, policy: str, slo_s: float, trace: st.Trace,
          res: WireRun, jobs: queue.Queue) -> None:
    """The link thread: decide each chunk when the link is free, fetch it, hand it to the compute thread
    (an exception is handed over too, so the compute thread never waits forever)."""
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
            res.rows[i].update(choice=name, est_gbps=est_used, lost=lost, arrival=arrival)
            if arrival is not None and not setup.option(name).recompute:
                est = arrival.gbps
            done = w.now() if arrival is None else arrival.last_byte
            gpu_free = max(done, gpu_free) + (setup.recompute_s(*chunk) if setup.option(name).recompute
                                              else setup.decode_s(*chunk, name))
            left -= chunk[1]
            jobs.put((i, name, arrival))
    except BaseException as e:   # noqa: BLE001 -- handed to the compute thread, which raises it
        jobs.put(e)


def _compute(w: wire.Wire, prep: Prepared, model, res: WireRun, jobs: queue.Queue) -> KVCache:
    """The compute thread: each chunk in order, decoded or recomputed onto the KV so far. A KV chunk is
    used only if its bytes pass their CRC and decode; otherwise it is recomputed (never a wrong KV)."""
    cache, n_kv = None, model.cfg.n_kv_heads
    for _ in prep.plan:
        job = jobs.get(timeout=COMPUTE_WAIT_S)
        if isinstance(job, BaseException):
            raise job
        i, name, arrival = job
        first, n = prep.plan[i]
        row, t0, why = res.rows[i], w.now(), None
        if arrival is not None:
            res.bytes_equal &= arrival.data == prep.payloads[name][i]
        if arrival is not None and name != "text":
            try:
                if not arrival.crc_ok:
                    raise CorruptStream(f"chunk {i}: its bytes fail their CRC")
                _, cache = _decode_onto(cache, arrival.data, prep.specs[int(name.removeprefix("level"))], n_kv,
                                        first, n)
            except (CorruptStream, ValueError) as e:
                why = f"recomputed: {e}"
        if arrival is None or name == "text" or why is not None:
            with torch.no_grad():
                _, cache = model(torch.tensor([prep.ids[first:first + n]]), cache=cache, last=True)
        row.update(compute_start=t0, ready=w.now(), compute_s=w.now() - t0, why=why)
        res.fell_back |= row["lost"] is not None
    return cache


def simulate(prep: Prepared, trace: st.Trace, policy: str, slo_s: float) -> st.Result:
    """The simulator on the same (scaled) trace with this CPU's measured times, in its parallel model; the
    adaptive policy as run() runs it."""
    setup = measured_setup(prep)
    if policy == "adaptive":
        return st.adaptive(setup, trace, slo_s, probe=False, give_up=False, parallel=True)
    return st.fixed(setup, trace, policy, parallel=True)


def parts(m: WireRun, prep: Prepared, trace: st.Trace, sim: st.Result | None = None) -> dict:
    """Where the run's seconds went beside the simulator's, summed over chunks (positive: the wire was
    slower): decode and recompute time (measured in the run against the times the simulator was fed),
    pacing granularity (the sender's last write after its plan), TCP (the request's way to the sender and
    the bytes' way back), Python overhead (the link thread's decision, the hand-over to the compute thread),
    and, given the simulated run `sim` with the same choices, the trace's timing: a chunk asked for a few ms
    later than simulated meets another stretch of the trace, and across a drop in bandwidth those ms cost
    the rest of the chunk's bytes at the slower rate (the trace's time for the chunk's bytes from the
    measured start against that from the simulated start)."""
    setup = measured_setup(prep)
    out = dict.fromkeys(("decode time", "recompute time", "pacing granularity", "TCP", "Python overhead",
                         "trace timing"), 0.0)
    prev_byte, prev_ready = 0.0, 0.0
    srows = sim.rows if sim is not None and sim.choices == m.choices else [None] * len(m.rows)
    for (first, n), r, sr in zip(prep.plan, m.rows, srows):
        a, opt = r["arrival"], setup.option(r["choice"])
        if opt.recompute or r["why"] is not None:
            out["recompute time"] += r["compute_s"] - setup.recompute_s(first, n)
        else:
            out["decode time"] += r["compute_s"] - setup.decode_s(first, n, opt.name)
        if a is not None:
            bits = 8 * len(a.data)
            out["TCP"] += (a.planned - trace.transfer_end(a.asked, bits)) + (a.last_byte - a.sent)
            out["pacing granularity"] += a.sent - a.planned
            out["Python overhead"] += a.asked - prev_byte
            if sr is not None:   # the same bits from the measured start and from the simulated one
                out["trace timing"] += ((trace.transfer_end(a.asked, bits) - a.asked)
                                        - (trace.transfer_end(sr["start"], bits) - sr["start"]))
            prev_byte = a.last_byte
        out["Python overhead"] += r["compute_start"] - max(prev_byte, prev_ready)
        prev_ready = r["ready"]
    return out


def cause(m: WireRun, s: st.Result, p: dict) -> str | None:
    """None when measured and simulated TTFT are within GAP_SHARE; else what differs: the choices (the
    socket measured another throughput than the trace's), or the part of the run's parts() `p` that cost
    most."""
    if abs(m.ttft_s - s.ttft_s) <= GAP_SHARE * m.ttft_s:
        return None
    if m.choices != s.choices:
        return "choices (the throughput measured on the socket)"
    sign = 1.0 if m.ttft_s > s.ttft_s else -1.0
    return max(p, key=lambda k: sign * p[k])


@dataclass(frozen=True)
class Compared:
    """One trace and policy measured on the wire and simulated with this CPU's times. The first six fields
    are the spec's wire_runs entry (entry()); then the answer's check, the cause of a TTFT gap above
    GAP_SHARE (None within it), the measured parts (parts()) and both timelines, per chunk (link start,
    link end, compute start, ready) seconds (the link's None for a chunk the wire did not carry)."""
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

    ENTRY = ("measured_ttft_s", "simulated_ttft_s", "measured_choices", "simulated_choices", "measured_slo_met",
             "simulated_slo_met")

    def entry(self) -> dict:
        return {k: getattr(self, k) for k in self.ENTRY}


def compare(prep: Prepared, model, trace: st.Trace, policy: str, slo_s: float, w: wire.Wire | None = None,
            check: AnswerCheck | None = None) -> Compared:
    """Run `policy` on the wire paced to `trace` (already scaled) and in the simulator, side by side (w,
    check: as run() takes them)."""
    m, s = run(prep, model, trace, policy, slo_s, w=w, check=check), simulate(prep, trace, policy, slo_s)
    p = parts(m, prep, trace, s)
    spans = [(None, None) if r["arrival"] is None else (r["arrival"].asked, r["arrival"].last_byte) for r in m.rows]
    spans = [link + (r["compute_start"], r["ready"]) for link, r in zip(spans, m.rows)]
    sim = [(r["start"], r["link_end"], r["gpu_start"], r["finish"]) for r in s.rows]
    return Compared(m.ttft_s, s.ttft_s, m.choices, s.choices, m.slo_met, s.ttft_s <= slo_s + 1e-12, m.first_token_kl,
                    m.same_answer, m.bytes_equal, cause(m, s, p), p,
                    [r["ready"] for r in m.rows], [r["finish"] for r in s.rows], spans, sim)

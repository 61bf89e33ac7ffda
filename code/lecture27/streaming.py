"""Streaming a context's KV over a link whose bandwidth changes (handout §4, CacheGen §5.3).

Pure logic for 03_streaming.py (which prints and plots): the bandwidth trace, the chunk-by-chunk
link/GPU simulation, CacheGen's adaptive policy and fixed policies. The oracle that knows the trace and
the suite of random traces the policies are compared over are stream/oracle.py's.

The adaptive policy is the rule of §4.2 (previous chunk's throughput assumed to hold, least lossy
configuration predicted to finish in time, text when nothing fits) with two rules that keep it measuring:
a probe of the idle link while the GPU recomputes, and a deadline after which a KV chunk stuck on a
collapsed link is given up and recomputed (see adaptive()).

The simulation, in one paragraph. The context is cut into chunks; each chunk is fetched either as KV at
one of the codec's levels (it occupies the link for bits / bandwidth) or as text (its token ids cross
the link, then the GPU recomputes the chunk attending to the KV of every earlier chunk). The link and
the GPU are two resources that work at once (parallel=True, 03's default): the link carries the chunks
in order, one transfer at a time, and starts the next chunk as soon as the previous one's bits or token
ids are across; the GPU recomputes the text chunks in order, each as soon as its token ids are in and
the GPU is free. A text chunk needs only the chunks before it, and the link delivered those first, so
while the GPU recomputes chunk i the link already fetches chunk i+1 (§4.2: "let the GPU recompute this
chunk with the KV received so far"), and that fetch measures the link. The serial model
(parallel=False) runs one chunk at a time: the link idles while the GPU recomputes, as a simpler reading
of §4.2 would have it; 03 can show both. Decoding a KV bitstream (a few ms on a GPU in CacheGen) and the
question's own prefill are the same for every policy and are left out: "TTFT" here is the time at which
the whole context's KV is on the GPU, the later of the link's last transfer and the GPU's last recompute.

Quality of a context = the token-weighted mean of its chunks' accuracies: a question about a record
is answered with the accuracy of the level its chunk arrived at; a text chunk is exact (recomputed), so
it counts as lossless (the FP16 accuracy).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from common import timemodel as tm
from common.stats import percentile

GBIT = 1e9
TEXT_BYTES_PER_TOKEN = 4      # a token id sent as int32 (a 128K vocabulary needs 17 bits)
TEXT_FLOOR_GBPS = 0.01        # adaptive's give-up deadline assumes token ids may crawl at 10 Mb/s (safety margin)
RISK_FACTOR = 2.0             # a KV chunk tried past that deadline must be predicted in time at half the measured rate


# ------------------------------------------------------------------------------------------- trace
@dataclass(frozen=True)
class Trace:
    """A piecewise-constant link: rate gbps[k] (Gb/s) from times[k] (s) until times[k+1]; the last
    rate holds forever. times[0] == 0."""
    times: tuple
    gbps: tuple

    def __post_init__(self):
        check_trace(self.times, self.gbps)

    @classmethod
    def steady(cls, gbps: float) -> "Trace":
        return cls((0.0,), (float(gbps),))

    def rate_at(self, t: float) -> float:
        k = max(i for i, s in enumerate(self.times) if s <= t) if t >= 0 else 0
        return self.gbps[k]

    def transfer_end(self, t0: float, bits: float) -> float:
        """When `bits` sent from t0 have all arrived (the link carries one transfer at a time)."""
        t, left = t0, bits
        for k, (start, rate) in enumerate(zip(self.times, self.gbps)):
            end = self.times[k + 1] if k + 1 < len(self.times) else math.inf
            if end <= t:
                continue
            t = max(t, start)
            can = rate * GBIT * (end - t)            # inf * 0 cannot happen: the last rate is > 0
            if can >= left:
                return t + left / (rate * GBIT)
            left -= can
            t = end
        raise AssertionError("unreachable: the last rate is positive")

    def bits_by(self, t: float) -> float:
        """Bits the link can carry in [0, t] (the oracle's budget; a figure's area)."""
        total = 0.0
        for k, (start, rate) in enumerate(zip(self.times, self.gbps)):
            end = self.times[k + 1] if k + 1 < len(self.times) else math.inf
            if start >= t:
                break
            total += rate * GBIT * (min(end, t) - start)
        return total


def check_trace(times, gbps) -> None:
    """Raise ValueError (one line) unless the trace is usable."""
    if len(times) == 0:
        raise ValueError("trace is empty")
    if len(times) != len(gbps):
        raise ValueError("trace needs one rate per time")
    if any(not math.isfinite(x) for x in list(times) + list(gbps)):
        raise ValueError("trace holds a non-finite number")
    if times[0] != 0:
        raise ValueError(f"trace must start at time 0, not {times[0]}")
    if any(b <= a for a, b in zip(times, times[1:])):
        raise ValueError("trace times must increase strictly")
    if any(r < 0 for r in gbps):
        raise ValueError(f"trace has a negative bandwidth ({min(gbps)} Gb/s)")
    if gbps[-1] <= 0:
        raise ValueError("the trace's last bandwidth must be positive (it holds forever)")


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def parse_trace(text: str) -> Trace:
    """CSV lines `time_s,gbit_per_s`; blank lines and lines starting with # are skipped, and so is a
    first line that is a header (not numbers). Raises ValueError with a one-line message."""
    times, gbps = [], []
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    for i, ln in enumerate(lines):
        parts = [p.strip() for p in ln.split(",")]
        try:
            if len(parts) != 2:
                raise ValueError
            t, r = float(parts[0]), float(parts[1])
        except ValueError:
            if i == 0 and len(parts) == 2 and not any(_is_number(p) for p in parts):
                continue                                # a header such as "time,gbps"
            raise ValueError(f"trace line {ln!r} is not 'time,Gb/s'") from None
        times.append(t)
        gbps.append(r)
    return Trace(tuple(times), tuple(gbps))


# ------------------------------------------------------------------------------ options and chunks
@dataclass(frozen=True)
class Option:
    name: str            # "level0".."level3", "raw" or "text"
    bits_per_token: float  # on the link
    accuracy: float      # answer accuracy of a chunk fetched this way
    recompute: bool = False
    bits_per_value: float | None = None  # KV options: the codec's bits per K/V value (raw: 16)


def kv_options(levels: list[dict], model, lossless_accuracy: float, with_raw=False) -> list[Option]:
    """The codec's levels applied to `model`: each level's measured bits per value times the model's
    values per token (K and V, all layers: kv_bytes_per_token / 2 at 2 bytes each); text last.
    Level order (finest first) is the policy's preference order."""
    values = tm.kv_bytes_per_token(model) / 2
    opts = [Option("raw", 16 * values, lossless_accuracy, bits_per_value=16.0)] if with_raw else []
    opts += [Option(f"level{lv['level']}", lv["bits_per_value"] * values, lv["accuracy"],
                    bits_per_value=lv["bits_per_value"]) for lv in sorted(levels, key=lambda d: d["level"])]
    return opts + [Option("text", 8 * TEXT_BYTES_PER_TOKEN, lossless_accuracy, recompute=True)]


def chunk_plan(context_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(first token, tokens) per chunk; the last chunk may be shorter."""
    return [(s, min(chunk_tokens, context_tokens - s)) for s in range(0, context_tokens, chunk_tokens)]


def batch_slowdown(n_tokens: int, half_tokens: float) -> float:
    """How much slower than the time model a recompute batch of n_tokens runs.
    A prefill batch of n tokens reaches n / (n + half_tokens) of the GPU's large-batch speed (small
    matmuls fill fewer tensor cores; kernel launches and the all-reduces' latency are paid per batch).
    The time model's MFU was fitted on a 12K-token batch (its anchor), so relative to it:
        slowdown(n) = (1 + half/n) / (1 + half/12K),   never below 1.
    03's HALF_EFFICIENCY_TOKENS = 128 is an assumption, not a measurement: it puts 512-token batches at 80%
    and 1.5K at 92% of full speed, in line with chunked-prefill practice (Sarathi-Serve, Agrawal et al. OSDI'24,
    runs prefill in chunks of 512-2048 tokens because such chunks already keep the GPU busy)."""
    fit_tokens = tm.ANCHOR_1GPU[2]
    return max(1.0, (1 + half_tokens / n_tokens) / (1 + half_tokens / fit_tokens))


@dataclass(frozen=True)
class Setup:
    """Everything one fetch needs besides the trace and the policy."""
    model: str
    gpu: str
    n_gpus: int
    plan: tuple                 # chunk_plan(...)
    options: tuple              # kv_options(...): levels finest first, text last
    half_tokens: float          # batch_slowdown's half-speed batch size

    @property
    def context_tokens(self) -> int:
        return sum(n for _, n in self.plan)

    def option(self, name: str) -> Option:
        return next(o for o in self.options if o.name == name)

    def recompute_s(self, first: int, n: int) -> float:
        """GPU seconds to recompute chunk [first, first+n) attending to the first `first` tokens."""
        return tm.prefill_time(self.model, self.gpu, n, first, self.n_gpus) * batch_slowdown(n, self.half_tokens)

    def decode_s(self, first: int, n: int, name: str) -> float:
        """GPU seconds to decode chunk [first, first+n)'s bitstream at option `name`: left out (0) on the
        lecture's GPUs; a setup measured on a CPU (wire.py) gives its decoder's times, and the chunk then
        occupies the GPU after its bits are in, as a recompute does."""
        return 0.0


def make_setup(model, gpu, n_gpus, context_tokens, chunk_tokens, levels, lossless_accuracy, half_tokens) -> Setup:
    return Setup(model, gpu, n_gpus, tuple(chunk_plan(context_tokens, chunk_tokens)),
                 tuple(kv_options(levels, model, lossless_accuracy)), half_tokens)


# -------------------------------------------------------------------------------------- one chunk
@dataclass(frozen=True)
class Transfer:
    """One chunk's transfer on the two resources: its KV bits, or its token ids, occupy the link from
    `start` to `link_end`; a text chunk then occupies the GPU for gpu_s seconds from `gpu_start` (None for
    KV, unless the setup gives a decode time: then its decode). `ready`: when the chunk's KV is on the GPU."""
    start: float
    link_end: float
    gpu_start: float | None
    gpu_s: float
    ready: float


def fetch_chunk(setup: Setup, trace: Trace, t0: float, chunk: tuple, opt: Option, gpu_free: float = 0.0) -> Transfer:
    """Fetch one chunk whose transfer starts on the link at t0. A text chunk is recomputed once its token
    ids are in and the GPU is free (gpu_free); the KV of every earlier chunk is in by then, since the link
    carries the chunks in order and the GPU recomputes them in order."""
    first, n = chunk
    link_end = trace.transfer_end(t0, opt.bits_per_token * n)
    if not opt.recompute:
        dec_s = setup.decode_s(first, n, opt.name)
        if dec_s == 0:
            return Transfer(t0, link_end, None, 0.0, link_end)
        gpu_start = max(link_end, gpu_free)
        return Transfer(t0, link_end, gpu_start, dec_s, gpu_start + dec_s)
    gpu_start, gpu_s = max(link_end, gpu_free), setup.recompute_s(first, n)
    return Transfer(t0, link_end, gpu_start, gpu_s, gpu_start + gpu_s)


def advance(f: Transfer, gpu_free: float, parallel: bool) -> tuple[float, float]:
    """(link free, GPU free) after transfer f. Parallel: the next chunk's transfer starts as soon as this
    chunk's bits or token ids are across, while the GPU may still recompute. Serial: it waits until
    this chunk is ready, so the link idles during a recompute."""
    if not parallel:
        return f.ready, f.ready
    return f.link_end, (gpu_free if f.gpu_start is None else f.ready)


def predict_s(setup: Setup, chunk: tuple, opt: Option, est_gbps: float, gpu_wait_s: float = 0.0) -> float:
    """Predicted seconds for a chunk if the link keeps est_gbps (the recompute time is known exactly); a
    text chunk's recompute starts after its token ids and after gpu_wait_s (the GPU's earlier work)."""
    first, n = chunk
    link = opt.bits_per_token * n / (est_gbps * GBIT) if est_gbps > 0 else math.inf
    return max(link, gpu_wait_s) + setup.recompute_s(first, n) if opt.recompute else link


@dataclass
class Result:
    policy: str
    # per chunk: _row(...): start, link_end, gpu_start, finish, gpu_s, choice, measured_gbps, and the policy's
    # est_gbps, budget_s, predicted; adaptive's also gave_up, probe, risked
    rows: list = field(default_factory=list)
    ttft_s: float = 0.0
    quality: float = 0.0                      # token-weighted accuracy
    text_tokens: int = 0
    gpu_s: float = 0.0                        # recompute seconds (all n_gpus busy)

    @property
    def choices(self) -> list[str]:
        return [r["choice"] for r in self.rows]


def _row(f: Transfer, name: str, measured, **policy) -> dict:
    """A chunk's row: start (its transfer starts on the link), link_end, gpu_start (text), finish (ready),
    gpu_s, choice, measured_gbps; a policy adds est_gbps, budget_s, predicted (a finish time), ..."""
    return dict(start=f.start, **policy, choice=name, finish=f.ready, gpu_s=f.gpu_s, measured_gbps=measured,
                link_end=f.link_end, gpu_start=f.gpu_start)


def _finish(res: Result, setup: Setup) -> Result:
    n_tok = [n for _, n in setup.plan]
    res.ttft_s = max((r["finish"] for r in res.rows), default=0.0)
    res.quality = sum(setup.option(r["choice"]).accuracy * n for r, n in zip(res.rows, n_tok)) / sum(n_tok)
    res.text_tokens = sum(n for r, n in zip(res.rows, n_tok) if setup.option(r["choice"]).recompute)
    res.gpu_s = sum(r["gpu_s"] for r in res.rows)
    return res


def replay(setup: Setup, trace: Trace, choices: list[str], policy="fixed", *, parallel: bool) -> Result:
    """Fetch the chunks in order with the given configurations (see advance() for when each starts)."""
    res, link, gpu = Result(policy), 0.0, 0.0
    for chunk, name in zip(setup.plan, choices):
        f = fetch_chunk(setup, trace, link, chunk, setup.option(name), gpu)
        res.rows.append(_row(f, name, _measured(setup, chunk, name, f), est_gbps=None, budget_s=None, predicted=None))
        link, gpu = advance(f, gpu, parallel)
    return _finish(res, setup)


def _measured(setup, chunk, name, f: Transfer):
    """Throughput of a KV chunk's transfer; None for text (a few KB of token ids measure nothing)."""
    opt = setup.option(name)
    return None if opt.recompute else opt.bits_per_token * chunk[1] / (f.link_end - f.start) / GBIT


def _rate(trace: Trace, a: float, b: float) -> float:
    """The link's mean throughput over [a, b], in Gb/s (what probe bytes sent then would measure)."""
    return (trace.bits_by(b) - trace.bits_by(a)) / (b - a) / GBIT


# ----------------------------------------------------------------------------------- the policy
def choose(setup: Setup, chunk: tuple, est_gbps: float, budget_s: float, allowed=None, gpu_wait_s: float = 0.0):
    """CacheGen's rule for one chunk: the least lossy configuration predicted to finish within its
    budget; levels finest first, then text (recompute costs the GPU time the cache exists to save, so
    it is the fallback, as in §4.2). If nothing fits, the fastest predicted option (on a collapsing link
    that is text). `allowed` (option names; text always) narrows the candidates; text waits gpu_wait_s
    for the GPU. Returns (option name, predicted seconds)."""
    preds = [(o.name, predict_s(setup, chunk, o, est_gbps, gpu_wait_s)) for o in setup.options
             if allowed is None or o.recompute or o.name in allowed]
    for name, p in preds:
        if p <= budget_s:
            return name, p
    return min(preds, key=lambda x: x[1])


PROBE_WINDOW_S = 0.01   # probe bytes are timed over windows this long: a change of rate is seen this late


def adaptive(setup: Setup, trace: Trace, slo_s: float, first_est_gbps: float | None = None,
             probe: bool = True, give_up: bool = True, *, parallel: bool) -> Result:
    """The adaptive policy (run_adaptive) on the simulator's clock: the link is the trace, the GPU's times are
    the setup's (SimLink), so what it measures of its own run is what it predicted (no margin)."""
    est = trace.rate_at(0.0) if first_est_gbps is None else first_est_gbps
    return run_adaptive(setup, SimLink(setup, trace, parallel, probe), slo_s, est, probe, give_up, parallel=parallel)


@dataclass(frozen=True)
class Margin:
    """What a run has measured of its own clock against the policy's predictions: `slowdown`, how many times
    its predicted seconds the compute has taken (never below 1: a faster compute is no reason to wait longer);
    `overhead_s`, seconds a chunk loses on top of its predicted compute (the hand-over from the link to the
    compute, a request's way to the sender). The policy predicts every decode and recompute `slowdown` times
    the setup's and keeps `overhead_s` per chunk left off each give-up deadline. The simulator's clock runs
    exactly as predicted: Margin() changes no decision."""
    slowdown: float = 1.0
    overhead_s: float = 0.0


class Slowed:
    """A setup whose decode and recompute take `slowdown` times the setup's: what the policy predicts with
    its margin (every other attribute is the setup's)."""

    def __init__(self, setup: Setup, slowdown: float):
        self.setup, self.slowdown = setup, slowdown

    def __getattr__(self, name):
        return getattr(self.setup, name)

    def recompute_s(self, first: int, n: int) -> float:
        return self.setup.recompute_s(first, n) * self.slowdown

    def decode_s(self, first: int, n: int, name: str) -> float:
        return self.setup.decode_s(first, n, name) * self.slowdown


class SimLink:
    """The simulator's link and GPU for run_adaptive: transfers as the trace carries them, the GPU's times the
    setup's. The interface a link gives the policy (a socket's is stream/wire_runs.py's):
      now(link_free): the time a chunk is decided, once the previous transfer ended at link_free;
      margin(): Margin, what the run has measured of itself so far;
      probe(t, gpu_free): probe bytes on the idle link from t: (the throughput measured, when the probe ended);
      fetch(i, chunk, name, t, gpu_free, give_up_at): fetch chunk i at option `name` from t: (its Transfer,
        the throughput its bits measured or None, the level given up or None). With give_up_at (a function of
        the time asked: the deadline with the margin learned by then, which only moves earlier as the run
        learns), a KV chunk not ready by then is given up: its transfer stopped, the chunk recomputed."""

    def __init__(self, setup: Setup, trace: Trace, parallel: bool, probe: bool):
        self.setup, self.trace, self.parallel, self.probing = setup, trace, parallel, probe

    def now(self, link_free: float) -> float:
        return link_free

    def margin(self) -> Margin:
        return Margin()

    def probe(self, t: float, gpu_free: float) -> tuple[float, float]:
        return _probe(self.trace, t, gpu_free)

    def fetch(self, i: int, chunk: tuple, name: str, t: float, gpu_free: float, give_up_at: float | None):
        setup, opt = self.setup, self.setup.option(name)
        f = fetch_chunk(setup, self.trace, t, chunk, opt, gpu_free)
        measured, gave_up = _measured(setup, chunk, name, f), None
        give_up_at = None if give_up_at is None else give_up_at(t)   # the margin does not move here
        if give_up_at is not None and f.ready > give_up_at:     # stop waiting: recompute it instead
            dec = setup.decode_s(*chunk, name)       # the moment it can no longer be ready in time
            when = give_up_at if dec == 0 else max(t, give_up_at - dec)
            measured = _rate(self.trace, t, when) if when != t else measured
            gave_up, f = name, fetch_chunk(setup, self.trace, when, chunk, setup.option("text"), gpu_free)
        if self.probing and not self.parallel and setup.option(gave_up and "text" or name).recompute:
            measured = _idle_link_rate(self.trace, f)
        return f, measured, gave_up


def run_adaptive(setup: Setup, link, slo_s: float, est_gbps: float, probe: bool = True, give_up: bool = True, *,
                 parallel: bool) -> Result:
    """Chunk by chunk, as soon as the link is free: the throughput measured on the previous KV chunk is
    assumed to hold; each chunk gets its token share of the time left before the SLO, budget = (SLO -
    now) * n_chunk / n_left, i.e. "if every remaining chunk took this long, the context would arrive on
    time", and choose() picks its configuration (a text chunk's prediction includes waiting for the GPU).
    The first chunk uses est_gbps. `link` is the clock and the link it runs on (SimLink's interface): the
    simulator's, or a real socket's; the decisions are the same code on either.

    Two rules keep the policy measuring, so that it never gets stuck:
    - probe (keep measuring during text): token ids are too few bytes to measure a link. In the parallel
      model the chunk after a text chunk is fetched while the GPU recomputes, and a KV transfer measures
      the link; but when text is chosen again while the GPU is still busy, nothing would be learned
      before that text is queued, so the policy sends probe bytes on the idle link until the GPU is free
      and decides the chunk again with their throughput (row["probe"]). In the serial model the link is
      idle during every recompute; the probe bytes then fill it and their throughput is the text row's
      measurement. Either way a link that recovers is seen and the policy goes back to KV.
    - give_up (never stuck in a KV transfer): while recomputing everything left (all-text) would still
      meet the SLO, a KV chunk is started with a deadline, the last moment from which all-text still
      meets it (token ids counted at TEXT_FLOOR_GBPS; the GPU must be free by then too). If the link
      collapses mid-transfer and the chunk is not ready by then, the policy stops waiting, measures the
      link from the bits that did arrive, and recomputes the chunk instead (the recompute of a chunk costs
      the same whoever does it).
      One exception: a chunk predicted to miss that deadline, but to arrive RISK_FACTOR times faster
      than needed for the chunks after it to still be recomputed in time, is waited for
      (row["risked"]). Without it a policy that once gave up would sit on the deadline, where every
      KV try is given up at once, and recompute every later chunk even on a fast link.
      So: whenever "always text" meets the SLO, the adaptive policy does too, unless the link fell
      below 1/RISK_FACTOR of its measured rate during a risked chunk.
      When even all-text cannot meet the SLO there is no deadline: the chunk is waited for.
    The margin (link.margin(): how much slower than predicted the run's compute has been, and what each
    chunk lost besides) is learned as the run goes: every prediction, the GPU's backlog and the deadlines
    take it, so a give-up deadline leaves room for the compute this run actually has.
    Each row records the choice actually fetched; a chunk given up on has choice "text" and
    gave_up = the level it abandoned (those link seconds are lost)."""
    est, res, t_link, gpu = est_gbps, Result("adaptive"), 0.0, 0.0
    left = setup.context_tokens
    deadline, known = None, None
    for i, chunk in enumerate(setup.plan):
        # §4.2: the throughput last measured (est) is assumed to hold, and choose() takes the least lossy
        # configuration predicted to finish within the chunk's token share of the time left (text if none)
        margin = link.margin()
        if margin != known:          # the deadlines with what the run has learned of its own compute
            known, pred = margin, Slowed(setup, margin.slowdown)
            deadline = _all_text_deadlines(pred, slo_s, margin.overhead_s)
        probed = False
        while True:
            t = link.now(t_link)
            budget = max(0.0, slo_s - t) * chunk[1] / left
            guard = _give_up_guard(pred, chunk, est, t, gpu, deadline[i], deadline[i + 1]) if give_up else None
            name, p = choose(pred, chunk, est, budget, None if guard is None else guard.allowed, gpu - t)
            if not (parallel and probe and _text_would_wait(setup.option(name), t, gpu)):
                break
            est, t_link = link.probe(t, gpu)                   # measure the idle link, then decide again
            probed = True
        risked = guard is not None and name in guard.risky
        at = None
        if guard is not None and not setup.option(name).recompute and not risked:
            at = _deadline_now(setup, link, slo_s, i, guard.at, known, gpu)
        f, measured, gave_up = link.fetch(i, chunk, name, t, gpu, at)
        probed |= probe and not parallel and (gave_up is not None or setup.option(name).recompute)
        res.rows.append(_row(f, "text" if gave_up else name, measured, est_gbps=est, budget_s=budget,
                             predicted=t + p, gave_up=gave_up, probe=probed, risked=risked) | dict(start=t))
        est = measured if measured is not None else est
        t_link, gpu = advance(f, gpu, parallel)
        left -= chunk[1]
    return _finish(res, setup)


def _deadline_now(setup: Setup, link, slo_s: float, i: int, at: float, known: Margin, gpu_free: float):
    """Chunk i's give-up deadline as a function of the time `now` the link asks it while it waits: `at`, or
    earlier once the margin the run has learned since the chunk was decided says so (a compute seen slower
    than before); none (inf) once that deadline is before now or before the GPU is free (gpu_free, as the
    chunk was decided): all-text is late too, so the chunk is waited for, as _give_up_guard has it."""
    def deadline(now: float) -> float:
        m = link.margin()
        if m == known:
            return at
        new = _all_text_deadlines(Slowed(setup, m.slowdown), slo_s, m.overhead_s)[i]
        return math.inf if new < max(now, gpu_free) else min(at, new)
    return deadline


def _all_text_deadlines(setup: Setup, slo_s: float, overhead_s: float = 0.0) -> list:
    """Entry i, for 0 <= i <= the number of chunks: the last moment from which recomputing chunks i, i+1,
    ... as text still meets the SLO (their token ids counted at TEXT_FLOOR_GBPS, and overhead_s lost per
    chunk: the margin's). Chunk i's give-up deadline is entry i; a chunk risked past it must still be in
    by entry i + 1."""
    ids_s = setup.option("text").bits_per_token / (TEXT_FLOOR_GBPS * GBIT)   # a token id at the floor rate
    rest_s = list(itertools.accumulate(setup.recompute_s(f, n) for f, n in reversed(setup.plan)))[::-1] + [0.0]
    rest_tokens = list(itertools.accumulate(n for _, n in reversed(setup.plan)))[::-1] + [0]
    if overhead_s == 0:
        return [slo_s - r - ids_s * n for r, n in zip(rest_s, rest_tokens)]
    rest_chunks = range(len(setup.plan), -1, -1)
    return [slo_s - r - ids_s * n - overhead_s * k for r, n, k in zip(rest_s, rest_tokens, rest_chunks)]


@dataclass(frozen=True)
class _Guard:
    """A KV chunk's give-up deadline: `at`, the last moment from which all-text still meets the SLO; the
    KV options the chunk may start (`allowed`), and those worth a risk (`risky`), waited for past `at`."""
    at: float
    allowed: frozenset
    risky: frozenset


def _give_up_guard(setup: Setup, chunk: tuple, est_gbps: float, t: float, gpu_free: float, at: float,
                   next_at: float) -> _Guard | None:
    """The guard of a chunk decided at t whose give-up deadline is `at` (the next chunk's: next_at), or
    None when all-text from this chunk on is already late (the link or the GPU busy past `at`): then
    whatever is chosen is waited for. A KV option is risky when it is predicted to miss `at`, but to be in
    RISK_FACTOR times earlier than next_at; once `at` has come, only the risky ones may start."""
    if not max(t, gpu_free) <= at + 1e-9:
        return None
    kv_pred = {o.name: predict_s(setup, chunk, o, est_gbps) for o in setup.options if not o.recompute}
    risky = frozenset(nm for nm, p in kv_pred.items() if t + p > at and t + RISK_FACTOR * p <= next_at)
    return _Guard(at, frozenset(kv_pred) if at - t > 1e-9 else risky, risky)


def _text_would_wait(opt: Option, t: float, gpu_free: float) -> bool:
    """Text chosen while the GPU is still busy: nothing would measure the link before it is queued."""
    return opt.recompute and gpu_free - t > 1e-9


def _probe(trace: Trace, t: float, gpu_free: float) -> tuple[float, float]:
    """Probe bytes on the idle link from t until the GPU is free or a change of rate is seen:
    (the throughput they measure over the last PROBE_WINDOW_S, when the probe ends)."""
    change = next((s for s in trace.times if s > t), math.inf)
    end = min(gpu_free, change + PROBE_WINDOW_S)
    return _rate(trace, max(t, end - PROBE_WINDOW_S), end), end


def _idle_link_rate(trace: Trace, f: Transfer) -> float:
    """The serial model's probe: the throughput of probe bytes that filled the link while the GPU
    recomputed text chunk f."""
    return (trace.bits_by(f.ready) - trace.bits_by(f.ready - f.gpu_s)) / f.gpu_s / GBIT


def fixed(setup: Setup, trace: Trace, name: str, *, parallel: bool) -> Result:
    return replay(setup, trace, [name] * len(setup.plan), policy=f"always {name}", parallel=parallel)


# ---------------------------------------------------------------------------- Part 1: one shot
def whole_context_ttft(model, gpu, n_gpus, n_ctx, gbps, options, half_tokens) -> dict:
    """Seconds until n_ctx tokens of context are on the GPU over a steady link, per option: the whole
    context as one chunk (one transfer, or one recompute batch)."""
    setup = Setup(model, gpu, n_gpus, ((0, n_ctx),), tuple(options), half_tokens)
    return {o.name: predict_s(setup, (0, n_ctx), o, gbps) for o in options}


# ------------------------------------------------------------------------------------ over a suite of traces
def ttft_percentile(results: list, q: float) -> float:
    """The q-quantile (0..1) of TTFT over a suite (common.stats.percentile: nearest rank, ceil(q * n))."""
    return percentile([r.ttft_s for r in results], q)

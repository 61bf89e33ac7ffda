"""Streaming a context's KV over a link whose bandwidth changes (handout §4, CacheGen §5.3).

Pure logic for 03_streaming.py (which prints and plots): the bandwidth trace, the chunk-by-chunk
link/GPU simulation, CacheGen's adaptive policy, fixed policies, and an oracle that knows the trace.

The adaptive policy is the rule of §4.2 (previous chunk's throughput assumed to hold, least lossy
configuration predicted to finish in time, text when nothing fits) with two rules that keep it measuring:
a probe of the idle link while the GPU recomputes a text chunk, and a deadline after which a KV chunk
stuck on a collapsed link is given up and recomputed (see adaptive()). trace_suite() draws many traces
from a Markov chain of bandwidths, as CacheGen's evaluation replays many throughput traces, and
run_suite() / suite_summary() give each policy's SLO-violation rate, TTFT and quality over them.

The simulation, in one paragraph. The context is cut into chunks; each chunk is fetched either as KV at
one of the codec's levels (it occupies the link for bits / bandwidth) or as text (its token ids cross
the link, then the GPU recomputes the chunk attending to the KV of every earlier chunk). Chunks go
strictly one after another, with NO overlap: while the GPU recomputes a text chunk the link is idle,
and the next chunk is decided only when the previous one is done. That is the simple reading of §4.2
(a text chunk needs all earlier KV first; the next decision wants a fresh measurement). Overlapping
the next chunk's transfer with a recompute would shave up to min(transfer, recompute) per text chunk;
it is left as an exercise. Decoding a KV bitstream (a few ms on a GPU in CacheGen) and the question's
own prefill are the same for every policy and are left out: "TTFT" here is the time at which the
whole context's KV is on the GPU.

Quality of a context = the token-weighted mean of its chunks' accuracies: a question about a record
is answered with the accuracy of the level its chunk arrived at; a text chunk is exact (recomputed), so
it counts as lossless (the FP16 accuracy).
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

from common import timemodel as tm

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


def make_setup(model, gpu, n_gpus, context_tokens, chunk_tokens, levels, lossless_accuracy, half_tokens) -> Setup:
    return Setup(model, gpu, n_gpus, tuple(chunk_plan(context_tokens, chunk_tokens)),
                 tuple(kv_options(levels, model, lossless_accuracy)), half_tokens)


# -------------------------------------------------------------------------------------- one chunk
def fetch_chunk(setup: Setup, trace: Trace, t0: float, chunk: tuple, opt: Option):
    """Fetch one chunk starting at t0 -> (finish time, link seconds, GPU seconds)."""
    first, n = chunk
    t_link = trace.transfer_end(t0, opt.bits_per_token * n)
    gpu_s = setup.recompute_s(first, n) if opt.recompute else 0.0
    return t_link + gpu_s, t_link - t0, gpu_s


def predict_s(setup: Setup, chunk: tuple, opt: Option, est_gbps: float) -> float:
    """Predicted seconds for a chunk if the link keeps est_gbps (the recompute time is known exactly)."""
    first, n = chunk
    link = opt.bits_per_token * n / (est_gbps * GBIT) if est_gbps > 0 else math.inf
    return link + (setup.recompute_s(first, n) if opt.recompute else 0.0)


@dataclass
class Result:
    policy: str
    # per chunk: dict(start, est_gbps, budget_s, choice, predicted, finish, measured_gbps, gpu_s; adaptive's also
    # gave_up, probe, risked)
    rows: list = field(default_factory=list)
    ttft_s: float = 0.0
    quality: float = 0.0                      # token-weighted accuracy
    text_tokens: int = 0
    gpu_s: float = 0.0                        # recompute seconds (all n_gpus busy)

    @property
    def choices(self) -> list[str]:
        return [r["choice"] for r in self.rows]


def _finish(res: Result, setup: Setup) -> Result:
    n_tok = [n for _, n in setup.plan]
    res.ttft_s = res.rows[-1]["finish"] if res.rows else 0.0
    res.quality = sum(setup.option(r["choice"]).accuracy * n for r, n in zip(res.rows, n_tok)) / sum(n_tok)
    res.text_tokens = sum(n for r, n in zip(res.rows, n_tok) if setup.option(r["choice"]).recompute)
    res.gpu_s = sum(r["gpu_s"] for r in res.rows)
    return res


def replay(setup: Setup, trace: Trace, choices: list[str], policy="fixed") -> Result:
    """Fetch the chunks with the given configurations, one after another."""
    res, t = Result(policy), 0.0
    for chunk, name in zip(setup.plan, choices):
        fin, link_s, gpu_s = fetch_chunk(setup, trace, t, chunk, setup.option(name))
        res.rows.append(dict(start=t, est_gbps=None, budget_s=None, choice=name, predicted=None,
                             finish=fin, gpu_s=gpu_s, measured_gbps=_measured(setup, chunk, name, link_s)))
        t = fin
    return _finish(res, setup)


def _measured(setup, chunk, name, link_s):
    """Throughput of a KV chunk's transfer; None for text (a few KB of token ids measure nothing)."""
    opt = setup.option(name)
    return None if opt.recompute else opt.bits_per_token * chunk[1] / link_s / GBIT


# ----------------------------------------------------------------------------------- the policy
def choose(setup: Setup, chunk: tuple, est_gbps: float, budget_s: float, allowed=None):
    """CacheGen's rule for one chunk: the least lossy configuration predicted to finish within its
    budget; levels finest first, then text (recompute costs the GPU time the cache exists to save, so
    it is the fallback, as in §4.2). If nothing fits, the fastest predicted option (on a collapsing link
    that is text). `allowed` (option names; text always) narrows the candidates. Returns (option name,
    predicted seconds)."""
    preds = [(o.name, predict_s(setup, chunk, o, est_gbps)) for o in setup.options
             if allowed is None or o.recompute or o.name in allowed]
    for name, p in preds:
        if p <= budget_s:
            return name, p
    return min(preds, key=lambda x: x[1])


def adaptive(setup: Setup, trace: Trace, slo_s: float, first_est_gbps: float | None = None,
             probe: bool = True, give_up: bool = True) -> Result:
    """Chunk by chunk: the throughput measured on the previous chunk is assumed to hold; each chunk gets
    its token share of the time left before the SLO, budget = (SLO - now) * n_chunk / n_left, i.e. "if
    every remaining chunk took this long, the context would arrive on time", and choose() picks its
    configuration. The first chunk uses first_est_gbps (default: a probe of the link at t = 0).

    Two rules keep the policy measuring, so that it never gets stuck:
    - probe (keep measuring during text): token ids are too few bytes to measure a link, but while the
      GPU recomputes a text chunk the link is idle anyway; the policy fills it with probe bytes and
      takes the throughput they got as its estimate. A link that recovers during the recompute is
      therefore seen at the next chunk, which goes back to KV. (Without it the estimate would stay at
      the rate measured before the text began, and the policy could recompute to the end.)
    - give_up (never stuck in a KV transfer): while recomputing everything left (all-text) would still
      meet the SLO, a KV chunk is started with a deadline, the last moment from which all-text still
      meets it (token ids counted at TEXT_FLOOR_GBPS). If the link collapses mid-transfer and the chunk
      is not in by then, the policy stops waiting, measures the link from the bits that did arrive,
      and recomputes the chunk instead (the recompute of a chunk costs the same whoever does it).
      One exception: a chunk predicted to miss that deadline, but to arrive RISK_FACTOR times faster
      than needed for the chunks after it to still be recomputed in time, is waited for
      (row["risked"]). Without it a policy that once gave up would sit on the deadline, where every
      KV try is given up at once, and recompute every later chunk even on a fast link.
      So: whenever "always text" meets the SLO, the adaptive policy does too, unless the link fell
      below 1/RISK_FACTOR of its measured rate during a risked chunk.
      When even all-text cannot meet the SLO there is no deadline: the chunk is waited for.
    Each row records the choice actually fetched; a chunk given up on has choice "text" and
    gave_up = the level it abandoned (those link seconds are lost)."""
    est = trace.rate_at(0.0) if first_est_gbps is None else first_est_gbps
    res, t = Result("adaptive"), 0.0
    left = setup.context_tokens
    text = setup.option("text")
    ids_s = text.bits_per_token / (TEXT_FLOOR_GBPS * GBIT)     # a token id's link time at the floor rate
    rest_text = list(itertools.accumulate(setup.recompute_s(f, n) for f, n in reversed(setup.plan)))[::-1] + [0.0]
    for i, chunk in enumerate(setup.plan):
        budget = max(0.0, slo_s - t) * chunk[1] / left
        give_up_at = slo_s - rest_text[i] - ids_s * left       # all-text from this chunk on still in time
        kv_due = slo_s - rest_text[i + 1] - ids_s * (left - chunk[1])  # ... from the next chunk on
        guard = give_up and t <= give_up_at + 1e-9
        allowed, risky = None, set()
        if guard:
            kv = {o.name: predict_s(setup, chunk, o, est) for o in setup.options if not o.recompute}
            risky = {nm for nm, p in kv.items() if t + p > give_up_at and t + RISK_FACTOR * p <= kv_due}
            allowed = set(kv) if give_up_at - t > 1e-9 else risky   # no time to try: only what is worth a risk
        name, pred = choose(setup, chunk, est, budget, allowed)
        row = dict(start=t, est_gbps=est, budget_s=budget, predicted=t + pred, gave_up=None, probe=False,
                   risked=name in risky)
        measured, t_go = None, t
        if not setup.option(name).recompute:
            fin, link_s, gpu_s = fetch_chunk(setup, trace, t, chunk, setup.option(name))
            measured = _measured(setup, chunk, name, link_s)
            if guard and name not in risky and fin > give_up_at:   # the link collapsed mid-chunk: stop waiting
                measured = (trace.bits_by(give_up_at) - trace.bits_by(t)) / (give_up_at - t) / GBIT
                row["gave_up"], name, t_go = name, "text", give_up_at
        if setup.option(name).recompute:
            fin, link_s, gpu_s = fetch_chunk(setup, trace, t_go, chunk, text)
            if probe:                                   # the link's throughput while the GPU recomputed
                measured = (trace.bits_by(fin) - trace.bits_by(fin - gpu_s)) / gpu_s / GBIT
                row["probe"] = True
        row.update(choice=name, finish=fin, gpu_s=gpu_s, measured_gbps=measured)
        res.rows.append(row)
        est = measured if measured is not None else est
        t, left = fin, left - chunk[1]
    return _finish(res, setup)


def fixed(setup: Setup, trace: Trace, name: str) -> Result:
    return replay(setup, trace, [name] * len(setup.plan), policy=f"always {name}")


# ----------------------------------------------------------------------------------- the oracle
def outcome_key(res: Result, slo_s: float):
    """How outcomes are ranked (smaller is better), by the policy's own rules: meet the SLO (else
    arrive as early as possible), then recompute as few tokens as possible, then lose as little
    quality as possible, then arrive early."""
    late = res.ttft_s > slo_s + 1e-12
    return (late, res.ttft_s if late else 0.0, res.text_tokens, -round(res.quality, 12), res.ttft_s)


def oracle(setup: Setup, trace: Trace, slo_s: float) -> Result:
    """The best configurations knowing the trace in advance (outcome_key), by dynamic programming over
    chunks. A partial schedule is kept unless another one is done no later, recomputed no more tokens
    and lost no more quality (then every continuation of it is at least as good, since a transfer
    started earlier never ends later). Partial schedules already past the SLO can only end late, so
    only the earliest of them is kept."""
    states = [(0.0, 0, 0.0, ())]               # (time, text tokens, -quality mass, choices)
    for chunk in setup.plan:
        nxt = []
        for t, txt, negq, ch in states:
            for o in setup.options:
                fin, _, _ = fetch_chunk(setup, trace, t, chunk, o)
                nxt.append((fin, txt + (chunk[1] if o.recompute else 0), negq - o.accuracy * chunk[1], ch + (o.name,)))
        late = [s for s in nxt if s[0] > slo_s]
        keep = sorted([s for s in nxt if s[0] <= slo_s]) + ([min(late)] if late else [])
        states, least = [], {}                 # least[text tokens] = least -quality mass kept with them
        for s in keep:                         # sorted by time: a state survives unless an earlier one dominates it
            if not any(txt <= s[1] and q <= s[2] + 1e-9 for txt, q in least.items()):
                states.append(s)
                least[s[1]] = min(least.get(s[1], math.inf), s[2])

    def key(s):                                # outcome_key from a state's own sums
        late = s[0] > slo_s + 1e-12
        return (late, s[0] if late else 0.0, s[1], round(s[2] / setup.context_tokens, 12), s[0])
    best = sorted(states, key=key)[:4]         # replayed, so that float sums in a different order cannot decide
    return min((replay(setup, trace, list(s[3]), policy="oracle") for s in best), key=lambda r: outcome_key(r, slo_s))


# ---------------------------------------------------------------------------- Part 1: one shot
def whole_context_ttft(model, gpu, n_gpus, n_ctx, gbps, options, half_tokens) -> dict:
    """Seconds until n_ctx tokens of context are on the GPU over a steady link, per option: the whole
    context as one chunk (one transfer, or one recompute batch)."""
    setup = Setup(model, gpu, n_gpus, ((0, n_ctx),), tuple(options), half_tokens)
    return {o.name: predict_s(setup, (0, n_ctx), o, gbps) for o in options}


# ------------------------------------------------------------------------------------ trace suite
def random_trace(rng, states, dwell, jump, horizon) -> Trace:
    """One bandwidth trace from a Markov chain over `states` (like the throughput traces CacheGen replays):
    a uniform first state; each state lasts a uniform time in `dwell`, then the link moves to a
    neighbouring state (up or down, equally likely) or, with probability `jump`, to any other state.
    Drawn until `horizon` seconds; the last rate holds forever."""
    k = rng.randrange(len(states))
    times, gbps, t = [0.0], [states[k]], 0.0
    while t < horizon:
        t += rng.uniform(*dwell)
        if rng.random() < jump:
            k = rng.choice([i for i in range(len(states)) if i != k])
        else:
            k = min(len(states) - 1, max(0, k + rng.choice((-1, 1))))
            if states[k] == gbps[-1]:
                continue                        # bounced off an end: the same rate lasts longer
        times.append(round(t, 6))
        gbps.append(states[k])
    return Trace(tuple(times), tuple(gbps))


def trace_suite(n: int, seed: int, states, dwell, jump, horizon) -> list[Trace]:
    """n traces from random_trace, reproducible from the seed."""
    rng = random.Random(seed)
    return [random_trace(rng, states, dwell, jump, horizon) for _ in range(n)]


SUITE_POLICIES = ("adaptive", "always level0", "always text", "oracle")


def run_suite(setup: Setup, traces: list, slo_s: float, policies=SUITE_POLICIES) -> dict:
    """{policy: [Result per trace]} for the adaptive policy, the fixed ones ("always <option>"), the oracle
    and "naive adaptive" (the same rule without the probe and the give-up deadline)."""
    run = {"adaptive": lambda tr: adaptive(setup, tr, slo_s), "oracle": lambda tr: oracle(setup, tr, slo_s),
           "naive adaptive": lambda tr: adaptive(setup, tr, slo_s, probe=False, give_up=False)}
    return {p: [run[p](tr) if p in run else fixed(setup, tr, p.removeprefix("always "))
                for tr in traces] for p in policies}


def suite_summary(results: list, slo_s: float) -> dict:
    """One policy over a suite: SLO-violation rate, mean TTFT, mean quality (of what arrived, late or not),
    mean quality on time (a context past the SLO counts 0: the user has given up), mean text tokens."""
    n = len(results)
    late = [r.ttft_s > slo_s + 1e-12 for r in results]
    return {"violation_rate": sum(late) / n, "mean_ttft_s": sum(r.ttft_s for r in results) / n,
            "mean_quality": sum(r.quality for r in results) / n,
            "mean_quality_on_time": sum(0.0 if x else r.quality for r, x in zip(results, late)) / n,
            "mean_text_tokens": sum(r.text_tokens for r in results) / n}


def ttft_percentile(results: list, q: float) -> float:
    """The q-quantile (0..1) of TTFT over a suite (nearest rank)."""
    xs = sorted(r.ttft_s for r in results)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def promise_exceptions(runs: dict, traces: list, slo_s: float, fixed_names=("always level0", "always text")):
    """Traces where a fixed policy meets the SLO and the adaptive one does not, each with its reason: the
    adaptive chunk that overran its prediction most (what it expected, what the link did meanwhile)."""
    out = []
    for i, tr in enumerate(traces):
        ad = runs["adaptive"][i]
        met = [p for p in fixed_names if runs[p][i].ttft_s <= slo_s + 1e-12]
        if not met or ad.ttft_s <= slo_s + 1e-12:
            continue
        k, row = max(enumerate(ad.rows), key=lambda kr: kr[1]["finish"] - kr[1]["predicted"])
        seg = [g for t, g in zip(tr.times, tr.gbps) if row["start"] <= t < row["finish"]]
        low = min([tr.rate_at(row["start"])] + seg)
        out.append({"trace": i, "fixed_met": met, "adaptive_ttft_s": ad.ttft_s, "chunk": k,
                    "choice": row["choice"], "est_gbps": row["est_gbps"], "start_s": row["start"],
                    "predicted_s": row["predicted"], "finish_s": row["finish"], "lowest_gbps": low})
    return out

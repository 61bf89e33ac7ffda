"""What 03 compares CacheGen's adaptive policy with (handout §4.2): an oracle that knows the trace in advance
and finds the best configurations for it, and a suite of random traces (a Markov chain of bandwidths, as
CacheGen's evaluation replays many throughput traces) over which run_suite() / suite_summary() give each
policy's SLO-violation rate, TTFT and quality. The link, the GPU and the policies are streaming.py's.
"""
from __future__ import annotations

import bisect
import itertools
import math
import random

from lecture27.streaming import Result, Setup, Trace, adaptive, advance, fetch_chunk, fixed, replay


# ----------------------------------------------------------------------------------- the oracle
def outcome_key(res: Result, slo_s: float):
    """How outcomes are ranked (smaller is better), by the policy's own rules: meet the SLO (else
    arrive as early as possible), then recompute as few tokens as possible, then lose as little
    quality as possible, then arrive early."""
    late = res.ttft_s > slo_s + 1e-12
    return (late, res.ttft_s if late else 0.0, res.text_tokens, -round(res.quality, 12), res.ttft_s)


def _undominated(states: list) -> list:
    """The states (link free, GPU free, text tokens, -quality mass, ...) that no other one dominates, i.e.
    is no later on both clocks, recomputed no more tokens and lost no more quality. `states` must be
    sorted (by link time first), so only the other three need checking: per text-token count, a staircase
    of (GPU time, least -quality mass among states with that GPU time or earlier)."""
    kept, stairs = [], {}                  # stairs[text tokens] = ([GPU times ascending], [-quality descending])
    for s in states:
        _, g, txt, q = s[:4]
        beaten = False
        for tx, (gs, qs) in stairs.items():
            k = bisect.bisect_right(gs, g) - 1
            if tx <= txt and k >= 0 and qs[k] <= q + 1e-9:
                beaten = True
                break
        if beaten:
            continue
        kept.append(s)
        gs, qs = stairs.setdefault(txt, ([], []))
        k = bisect.bisect_right(gs, g)
        end = k
        while end < len(gs) and qs[end] >= q:   # entries from g on that the new state beats
            end += 1
        gs[k:end], qs[k:end] = [g], [q]
    return kept


def _can_finish_by(setup: Setup, trace: Trace, i: int, deadline: float):
    """A test of whether a partial schedule of chunks 0..i-1, with clocks (link free, GPU free), can still
    finish by `deadline`. It is a relaxation, so it never rejects one that can: every remaining chunk goes
    either on the link at the coarsest level or on the GPU as text (token ids free); the link takes the k
    smallest, the GPU the rest of the cheapest recomputes, for the largest k the link can carry by then."""
    rest = setup.plan[i:]
    coarsest = min(o.bits_per_token for o in setup.options if not o.recompute)
    bits = [0.0, *itertools.accumulate(sorted(coarsest * n for _, n in rest))]
    gpu = [0.0, *itertools.accumulate(sorted(setup.recompute_s(f, n) for f, n in rest))]
    deadline += 1e-9                                         # a clock may pass the deadline by float rounding ...
    by = trace.bits_by(deadline) * (1 + 1e-12) + 1.0          # ... and the bits by then with it (a bit of slack for
                                                              # float sums): a link free by the deadline has room

    def test(link: float, gpu_free: float) -> bool:
        if max(link, gpu_free) > deadline:
            return False
        k = bisect.bisect_right(bits, by - trace.bits_by(link)) - 1      # chunks the link can still carry
        return gpu_free + gpu[len(rest) - k] <= deadline
    return test


def _schedules(setup: Setup, trace: Trace, deadline: float, parallel: bool, to_beat: Result | None = None,
               clocks_only: bool = False) -> list:
    """Dynamic programming over chunks: the undominated complete schedules that finish by `deadline`, as
    states (link free, GPU free, text tokens, -quality mass, choices). A partial schedule is dropped when
    another one dominates it (_undominated), since then every continuation of it is at least as good (a
    transfer started earlier never ends later, nor does a recompute that can start earlier); when it can
    no longer finish by the deadline (_can_finish_by); or, given an on-time schedule `to_beat`, when it
    has recomputed more tokens than that one, or as many and cannot reach its quality. clocks_only:
    dominance by the two clocks alone (text tokens and quality counted as 0), for the earliest TTFT."""
    states = [(0.0, 0.0, 0, 0.0, ())]
    most_text = to_beat.text_tokens if to_beat else math.inf
    least_loss = -to_beat.quality * setup.context_tokens if to_beat else math.inf
    best_kv = max(o.accuracy for o in setup.options if not o.recompute)
    left = setup.context_tokens
    for i, chunk in enumerate(setup.plan):
        nxt = []
        left -= chunk[1]
        for link, gpu, txt, negq, ch in states:
            for o in setup.options:
                txt2, negq2 = txt + (chunk[1] if o.recompute else 0), negq - o.accuracy * chunk[1]
                if clocks_only:
                    txt2, negq2 = 0, 0.0
                if txt2 > most_text or (txt2 == most_text and negq2 - best_kv * left > least_loss + 1e-9):
                    continue
                f = fetch_chunk(setup, trace, link, chunk, o, gpu)
                nxt.append((*advance(f, gpu, parallel), txt2, negq2, ch + (o.name,)))
        alive = _can_finish_by(setup, trace, i + 1, deadline)
        states = _undominated(sorted(s for s in nxt if alive(s[0], s[1])))
    return states


def _greedy(setup: Setup, trace: Trace, parallel: bool) -> list[str]:
    """A schedule that only balances the two resources: each chunk takes the option after which the
    later of the two clocks is earliest."""
    link, gpu, out = 0.0, 0.0, []
    for chunk in setup.plan:
        nxt = [(max(c), c, o.name) for o in setup.options
               for c in [advance(fetch_chunk(setup, trace, link, chunk, o, gpu), gpu, parallel)]]
        _, (link, gpu), name = min(nxt, key=lambda x: x[0])
        out.append(name)
    return out


def oracle(setup: Setup, trace: Trace, slo_s: float, *, parallel: bool) -> Result:
    """The best configurations knowing the trace in advance (outcome_key). A few simple schedules first
    (every fixed policy, _greedy, the adaptive policy's choices); if none meets the SLO, also the earliest
    schedule of all (searched by the two clocks alone, a much smaller search). If one of them meets the
    SLO, the search keeps only what can beat it on time; else the best schedule is among those that
    arrive as early as the earliest. A schedule's TTFT is the later of its two clocks."""
    guesses = [[o.name] * len(setup.plan) for o in setup.options]
    guesses += [_greedy(setup, trace, parallel), adaptive(setup, trace, slo_s, parallel=parallel).choices]
    by_key = lambda r: outcome_key(r, slo_s)  # noqa: E731
    simple = min((replay(setup, trace, g, "oracle", parallel=parallel) for g in guesses), key=by_key)
    if simple.ttft_s > slo_s + 1e-12:
        fastest = min(_schedules(setup, trace, simple.ttft_s, parallel, clocks_only=True), key=lambda s: max(s[:2]))
        simple = min(simple, replay(setup, trace, list(fastest[4]), "oracle", parallel=parallel), key=by_key)
    on_time = simple.ttft_s <= slo_s + 1e-12
    states = _schedules(setup, trace, slo_s if on_time else simple.ttft_s, parallel, simple if on_time else None)

    def key(s):                                # outcome_key from a state's own sums
        ttft = max(s[:2])
        late = ttft > slo_s + 1e-12
        return (late, ttft if late else 0.0, s[2], round(s[3] / setup.context_tokens, 12), ttft)
    best = sorted(states, key=key)[:4]         # replayed, so that float sums in a different order cannot decide
    return min([replay(setup, trace, list(s[4]), "oracle", parallel=parallel) for s in best] + [simple], key=by_key)


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


def run_suite(setup: Setup, traces: list, slo_s: float, policies=SUITE_POLICIES, *, parallel: bool) -> dict:
    """{policy: [Result per trace]} for the adaptive policy, the fixed ones ("always <option>"), the oracle
    and "naive adaptive" (the same rule without the probe and the give-up deadline), all in the parallel
    or the serial model (advance())."""
    run = {"adaptive": lambda tr: adaptive(setup, tr, slo_s, parallel=parallel),
           "oracle": lambda tr: oracle(setup, tr, slo_s, parallel=parallel),
           "naive adaptive": lambda tr: adaptive(setup, tr, slo_s, probe=False, give_up=False, parallel=parallel)}
    return {p: [run[p](tr) if p in run else fixed(setup, tr, p.removeprefix("always "), parallel=parallel)
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

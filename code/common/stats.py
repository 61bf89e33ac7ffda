"""One percentile for every table of times: the benchmark's TTFT p50 and p99 and the streaming suite's p95."""
from __future__ import annotations

import math


def percentile(values, q: float) -> float:
    """The q-quantile (0 < q <= 1) of `values` by nearest rank: the ceil(q * n)-th smallest of the n values (the
    first for q * n <= 1), a value that was measured, never an interpolation. For an even count the median is the
    lower middle one: the p50 of [1, 2, 3, 4] is 2; the p99 of fewer than 100 values is their largest."""
    xs = sorted(values)
    if not xs:
        raise ValueError("the percentile of no values")
    if not 0 < q <= 1:
        raise ValueError(f"q = {q}: a quantile in (0, 1]")
    rank = math.ceil(round(q * len(xs), 9))   # rounded first: 0.07 * 100 is 7.000000000000001 in floats, rank 7
    return xs[min(len(xs), max(1, rank)) - 1]

"""One timer for every measured time: (result, seconds) of a call, or of the fastest of several calls."""
from __future__ import annotations

import math
import time


def timed(fn, clock=time.perf_counter):
    """(fn(), seconds it took on `clock`): the wall clock by default; time.process_time counts only this
    process's CPU time, which on one torch thread is what an idle core would take (a shared machine's
    waits for a core are left out, so a cached time does not freeze them in)."""
    t = clock()
    out = fn()
    return out, clock() - t


def fastest(fn, repeats: int, clock=time.perf_counter, enough_s: float = math.inf):
    """(the last call's fn(), the fewest seconds of `repeats` calls): a coder's or a decoder's time on a shared
    machine, where a call that waited for a core is slower than the code, never faster. A call of enough_s or more
    ends the repeats: it spans hundreds of the scheduler's time slices, so a wait for a core is a small part of it."""
    out, best = None, math.inf
    for _ in range(repeats):
        out, seconds = timed(fn, clock)
        best = min(best, seconds)
        if seconds >= enough_s:
            break
    return out, best

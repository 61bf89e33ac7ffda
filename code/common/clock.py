"""One timer for every measured time: (result, seconds) of a call."""
from __future__ import annotations

import time


def timed(fn, clock=time.perf_counter):
    """(fn(), seconds it took on `clock`): the wall clock by default; time.process_time counts only this
    process's CPU time, which on one torch thread is what an idle core would take (a shared machine's
    waits for a core are left out, so a cached time does not freeze them in)."""
    t = clock()
    out = fn()
    return out, clock() - t

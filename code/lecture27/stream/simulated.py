"""The simulator (streaming.py, its parallel model) fed the times measured on this CPU (measure.prepare): the
same trace and policy as a run on the wire, so that the two can stand side by side (compare.py)."""
from __future__ import annotations

from dataclasses import dataclass

from lecture27 import streaming as st


@dataclass(frozen=True, kw_only=True)
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


def measured_setup(prep) -> MeasuredSetup:
    """The setup of a measured context (measure.Prepared): its chunks, its options, its measured times."""
    return MeasuredSetup(model="measured", gpu="this CPU", n_gpus=1, plan=prep.plan, options=prep.options,
                         half_tokens=0.0, recompute=prep.recompute_s, decode=tuple(prep.decode_s.items()))


def simulate(prep, trace: st.Trace, policy: str, slo_s: float) -> st.Result:
    """The simulator on the same (scaled) trace with this CPU's measured times, in its parallel model; the
    adaptive policy is the one a run on the wire runs (streaming.adaptive: the probe and the give-up deadline,
    on the simulator's clock, where the compute runs as predicted: no margin)."""
    setup = measured_setup(prep)
    if policy == "adaptive":
        return st.adaptive(setup, trace, slo_s, parallel=True)
    return st.fixed(setup, trace, policy, parallel=True)

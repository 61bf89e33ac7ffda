"""Selection rules for blend_world.blend beside the handout's progressive filter, and the oracle that
bounds them all (handout §5.3; measured on a real model in blend_real.py).

A rule is what blend() asks three things of (blend_world.Filter): how many tokens each layer
recomputes, what ranks the tokens a layer has just recomputed, and which of them go on. Each rule here
changes one of the three:
  flat         the filter recomputing r N tokens at every layer (schedule 1.0)
  check-k/-v/-kv  one fixed set chosen at one check layer, as the released systems do: LMCache's blender
               ranks by the *key* deviation at check layer 1 (BLEND_CHECK_LAYERS = 1, recompute ratio
               0.15) and keeps that set; the CacheBlend repository ranks by the *value* deviation at one
               check layer (ratio 0.16), the query always recomputed. Layers 0..1 are computed in full.
  Random       another rule's counts, the tokens drawn at random (the baseline: picking matters)
  oracle_cache not a rule but a ceiling: the full prefill's own K, V for the most deviated tokens
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

import torch  # noqa: E402

import blend_world as bw  # noqa: E402
from common.llama import KVCache  # noqa: E402

FLAT = bw.Filter(schedule=(1.0,))


@dataclass(frozen=True)
class CheckLayer(bw.Filter):
    """Layers 1..`layer` recompute every token; at `layer` the tokens are ranked by their K, V or K+V
    deviation (`by`) and the top ceil(r N) are recomputed at every later layer (the schedule after the
    check layer; flat: the same set, no further filtering)."""
    schedule: tuple = FLAT.schedule
    layer: int = 1
    by: str = "kv"

    def counts(self, n_tokens: int, ratio: float, n_layers: int) -> list[int]:
        after = super().counts(n_tokens, ratio, n_layers)
        return [n_tokens if i <= self.layer else after[i - 1] for i in range(1, n_layers)]

    def score(self, dev_k: torch.Tensor, dev_v: torch.Tensor) -> torch.Tensor:
        return {"k": dev_k, "v": dev_v, "kv": dev_k + dev_v}[self.by]


# blend()'s rules by name (blend_real measures every one; 04 --rule picks one)
RULES = {"progressive": bw.PROGRESSIVE, "flat": FLAT,
         "check-k": CheckLayer(by="k"), "check-v": CheckLayer(by="v"), "check-kv": CheckLayer(by="kv")}


@dataclass(frozen=True)
class Random:
    """The baseline: as many tokens as `like` recomputes at each layer, chosen at random (seeded by
    `generator`, one draw per layer) instead of by deviation."""
    generator: torch.Generator
    like: bw.Filter = bw.PROGRESSIVE

    def counts(self, n_tokens: int, ratio: float, n_layers: int) -> list[int]:
        return self.like.counts(n_tokens, ratio, n_layers)

    def score(self, dev_k: torch.Tensor, dev_v: torch.Tensor) -> torch.Tensor:
        return self.like.score(dev_k, dev_v)  # only its shape is read

    def keep(self, score: torch.Tensor, n: int) -> torch.Tensor:
        return torch.rand(score.shape, generator=self.generator).argsort(1)[:, :n].sort(1).values


def oracle_cache(pre: KVCache, full: KVCache, ratio: float) -> KVCache:
    """The ceiling of any selection rule at ratio r: at every layer, the ceil(r N) context tokens whose
    precomputed K, V deviate most (||dK||^2 + ||dV||^2) from the full prefill's get the full prefill's
    K, V. No compute model: a perfect selector that also recomputed them exactly. `full` may hold more
    rows than the context (a prefill of context + question): its first N are used."""
    N = pre.k[0].shape[2]
    n = min(N, math.ceil(ratio * N - 1e-9))
    ks, vs = [], []
    for kp, vp, kf, vf, dev in zip(pre.k, pre.v, full.k, full.v, bw.cache_deviation(pre, full)):
        idx = dev.topk(n, dim=1).indices[:, None, :, None].expand(kp.shape[0], kp.shape[1], n, kp.shape[3])
        ks.append(kp.scatter(2, idx, kf.gather(2, idx)))
        vs.append(vp.scatter(2, idx, vf.gather(2, idx)))
    return KVCache(ks, vs, pre.pos)

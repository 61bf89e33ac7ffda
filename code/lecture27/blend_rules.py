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
  Adaptive     one check layer whose count adapts to the input: the smallest set holding a fixed share
               of the deviation measured there (at least r N tokens)

Two ceilings split a rule's distance from full prefill in two:
  RankingOracle  another rule's counts and nesting, the tokens picked by their true deviation from a
               full prefill; recomputed as blend() does, from the mixed cache. Rule -> ranking oracle is
               what the rule's ranking loses.
  oracle_cache   the patch oracle: the full prefill's own K, V for the most deviated tokens of every
               layer, no recompute. Ranking oracle -> patch oracle is what recomputing from a partly
               stale cache loses (a recomputed token attends to neighbours that kept their stale K, V).
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


@dataclass(frozen=True)
class Adaptive(CheckLayer):
    """A check layer whose count adapts to the input: at `layer` the tokens are ranked by their
    measured deviation (`by`, as CheckLayer; `layer` 0 ranks by layer 0's attention deviation, at no
    extra cost) and the smallest set holding `share` of the total, never fewer than ceil(r N), is
    recomputed at every later layer. An input whose deviation is spread over many tokens (short chunks:
    more boundaries) gets more of them. With a batch, every row keeps the largest row's count."""
    share: float = 0.9

    def keep(self, score: torch.Tensor, n: int, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        B, m = score.shape
        if layer == self.layer + 1:  # the check: as many as the share needs, at least the floor n
            held = score.sort(1, descending=True).values.cumsum(1) / score.sum(1, keepdim=True).clamp_min(1e-30)
            n = max(n, int((held < self.share - 1e-9).sum(1).max()) + 1)
            return super().keep(score, min(n, m), tokens, layer)
        return torch.arange(m).expand(B, m)  # before the check every token, after it the check's set


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

    def keep(self, score: torch.Tensor, n: int, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        return torch.rand(score.shape, generator=self.generator).argsort(1)[:, :n].sort(1).values


@dataclass(frozen=True)
class RankingOracle:
    """`like`'s counts and nesting (a layer recomputes only tokens the layer below recomputed: only those
    have fresh hidden states), but wherever `like` picks or narrows its set, the n tokens kept are those
    with the largest true deviation still ahead of them: ||dK||^2 + ||dV||^2 of the precomputed K, V
    against a full prefill's, summed over the layers the set goes on to (`layer` to the last).
    deviation (L, B, N): blend_world.kv_deviation of the same input. blend() then recomputes them from
    the mixed cache as for any rule."""
    like: bw.Filter
    deviation: torch.Tensor

    def counts(self, n_tokens: int, ratio: float, n_layers: int) -> list[int]:
        return self.like.counts(n_tokens, ratio, n_layers)

    def score(self, dev_k: torch.Tensor, dev_v: torch.Tensor) -> torch.Tensor:
        return self.like.score(dev_k, dev_v)  # only its shape is read

    def keep(self, score: torch.Tensor, n: int, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        ahead = self.deviation[layer:].sum(0).gather(1, tokens)  # (B, m) true deviation still to remove
        return ahead.topk(n, dim=1).indices.sort(1).values


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

"""Selection rules for blend_world.blend beside the handout's progressive filter, the oracle that bounds
them all (handout §5.3; measured on a real model in blend/rag.py), and the one registry of the rules' names.

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

Rules that read the input before blend() runs (INPUT_RULES; their `ready(model, rec, chunks, pre)` does that
work and returns the rule blend() is given, so that the work is inside whatever times it; every other rule's
ready, blend_world.Filter's, returns the rule itself):
  query        flat's counts, the set picked by what the question reads: the question's tokens run over
               full reuse's cache (its stale K, V) and every context token is scored by the attention the
               question pays it at layers 1..j, summed over heads and question tokens (QueryAttention)
  query+dev    that score and layer 0's attention deviation, each as a share of its total, added
  chunk-start  flat's counts, the first tokens of every chunk (EPIC's LegoLink, Hu et al. 2024,
               arXiv 2410.15332): a chunk precomputed alone misses most at its start (ChunkStart)

Two ceilings split a rule's distance from full prefill in two:
  RankingOracle  another rule's counts and nesting, the tokens picked by their true deviation from a
               full prefill; recomputed as blend() does, from the mixed cache. Rule -> ranking oracle is
               what the rule's ranking loses.
  oracle_cache   the patch oracle: the full prefill's own K, V for the most deviated tokens of every
               layer, no recompute. Ranking oracle -> patch oracle is what recomputing from a partly
               stale cache loses (a recomputed token attends to neighbours that kept their stale K, V).

The registry: RULES, INPUT_RULES and ALL_RULES map names to rules; RULE_NAMES, INPUT_RULE_NAMES and
ALL_RULE_NAMES are their names in order, QUERY_RULES the rules whose depth j varies (at_depth, depth_name),
blend_rule_of the rule of RULES whose counts a rule keeps; recompute_share and work_share are what a rule
computes, as a share of a full prefill.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from lecture27 import blend_world as bw
from common.llama import KVCache, causal_mask

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


# blend()'s rules by name (blend/rag.py measures every one; 04 --rule picks one)
RULES = {"progressive": bw.PROGRESSIVE, "flat": FLAT,
         "check-k": CheckLayer(by="k"), "check-v": CheckLayer(by="v"), "check-kv": CheckLayer(by="kv")}


def exact_tokens(n_tokens: int, chunks) -> torch.Tensor:
    """(N,) bool: context tokens whose precompute already saw everything before them (the shared prefix,
    and the first chunk behind it): their stored K, V are a full prefill's, recomputing them gains nothing."""
    ids = bw.chunk_ids(n_tokens, chunks)
    pos = torch.arange(n_tokens)
    return (bw.own_chunk_mask(ids) == causal_mask(pos, pos)).all(1)


@torch.no_grad()
def question_attention(model, pre: KVCache, question: torch.Tensor, layers: int) -> torch.Tensor:
    """(B, N): the attention the question's tokens pay each of the N context tokens of `pre` at layers
    1..`layers`, summed over heads, question tokens and layers. The question (B, Tq) runs over `pre` as it
    is (full reuse: the stale K, V), each of its tokens seeing the context and the question tokens before
    it; layers 0..`layers` are computed (the work a rule ranking by it adds), the rest are not."""
    B, N = pre.k[0].shape[0], pre.k[0].shape[2]
    Tq = question.shape[1]
    pos_q = torch.arange(N, N + Tq)
    seen = causal_mask(pos_q, torch.arange(N + Tq))
    x, score = model.embed(question), torch.zeros(B, N)
    for layer in range(layers + 1):
        blk = model.layers[layer]
        q, k, v = blk.qkv(x, pos_q)
        k, v = torch.cat([pre.k[layer], k], 2), torch.cat([pre.v[layer], v], 2)
        w = blk.attention_weights(q, k, seen)  # (B, H, Tq, N + Tq)
        if layer >= 1:
            score += w[..., :N].sum((1, 2))
        if layer < layers:  # the next layer's input: this layer's output from the same weights
            x = blk.after_attention(x, blk.mix(w, v))
    return score


def share_of_total(x: torch.Tensor) -> torch.Tensor:
    """Each row of x (B, N) divided by its sum: scores of different units made comparable."""
    return x / x.sum(1, keepdim=True).clamp_min(1e-30)


@dataclass(frozen=True)
class QueryAttention(bw.Filter):
    """Flat's counts (ceil(r N) tokens at every layer 1..), the set picked once, before layer 1, by what the
    question reads: question_attention at layers 1..`layers` (None: every layer after 0). with_dev: that
    score and layer 0's attention deviation, each as a share of its total, added. Tokens whose stored
    K, V are already exact (exact_tokens) come last. `scores` (B, N) is filled by ready(); blend() is then
    given the filled rule."""
    schedule: tuple = FLAT.schedule
    layers: int | None = None
    with_dev: bool = False
    scores: torch.Tensor | None = None
    exact: torch.Tensor | None = None

    @property
    def reads_deviation(self) -> bool:
        return self.with_dev

    def depth(self, n_layers: int) -> int:
        """j: the last layer the question's attention is read from."""
        return n_layers - 1 if self.layers is None else min(self.layers, n_layers - 1)

    def ready(self, model, rec, chunks, pre: KVCache) -> QueryAttention:
        """The question's pass over full reuse's cache (the rule's own work), then the rule with its scores."""
        N = rec.doc.shape[1]
        return replace(self, scores=question_attention(model, pre, rec.question, self.depth(model.cfg.n_layers)),
                       exact=exact_tokens(N, chunks))

    def keep(self, score: torch.Tensor, n: int, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        if layer != 1:  # after layer 1 flat keeps the set it has
            return super().keep(score, n, tokens, layer)
        s = share_of_total(self.scores) + share_of_total(score) if self.with_dev else share_of_total(self.scores)
        return super().keep(s.masked_fill(self.exact, -1.0), n, tokens, layer)

    def extra_token_layers(self, n_question: int, n_layers: int) -> int:
        """Token-layers the question's pass adds to blend(): its tokens at layers 0..j."""
        return n_question * (self.depth(n_layers) + 1)


@dataclass(frozen=True)
class ChunkStart(bw.Filter):
    """EPIC's LegoLink (Hu et al. 2024, arXiv 2410.15332): flat's counts, the set the first tokens of every
    chunk whose stored K, V deviate (not the shared prefix, not the first chunk behind it: exact_tokens),
    taken in turns: every chunk's first token, then every chunk's second, ..., so that each chunk gets
    about ceil(r N) / chunks. A chunk shorter than its share leaves the rest to the others."""
    schedule: tuple = FLAT.schedule
    order: torch.Tensor | None = None
    reads_deviation = False

    def ready(self, model, rec, chunks, pre: KVCache) -> ChunkStart:
        N = rec.doc.shape[1]
        ids, exact = bw.chunk_ids(N, chunks), exact_tokens(N, chunks)
        offset = torch.zeros(N, dtype=torch.long)
        for start, end in bw.chunk_spans(ids):
            offset[start:end] = torch.arange(end - start)
        rank = (offset + exact.long() * N) * N + torch.arange(N)  # turn, then document order; exact tokens last
        return replace(self, order=-rank.to(torch.float64))

    def keep(self, score: torch.Tensor, n: int, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        if layer != 1:
            return super().keep(score, n, tokens, layer)
        return super().keep(self.order.expand(score.shape[0], -1), n, tokens, layer)


# rules that read the input before blend() runs (ready()); 04 --rule picks one of RULES or these
INPUT_RULES = {"query": QueryAttention(), "query+dev": QueryAttention(with_dev=True), "chunk-start": ChunkStart()}
ALL_RULES = {**RULES, **INPUT_RULES}


# ------------------------------------------------------------------------------------ the rules by name
RULE_NAMES = tuple(RULES)              # blend()'s selection rules, all measured
INPUT_RULE_NAMES = tuple(INPUT_RULES)  # the rules that read the input first
ALL_RULE_NAMES = (*RULE_NAMES, *INPUT_RULE_NAMES)
QUERY_RULES = ("query", "query+dev")  # the rules whose depth j (layers the question's attention is read from) varies


def at_depth(name: str, j: int) -> QueryAttention:
    """The query rule `name` reading the question's attention at layers 1..j."""
    return replace(INPUT_RULES[name], layers=j)


def depth_name(name: str, j: int) -> str:
    return f"{name} j={j}"


def blend_rule_of(rule: str) -> str:
    """The rule of RULES a rule shares its counts with: itself, or flat for an input rule (INPUT_RULES keep
    flat's counts: its ranking oracle is theirs)."""
    return rule if rule in RULES else "flat"


def recompute_share(n_context: int, ratio: float, n_layers: int, rule: str) -> float:
    """Context-token layers recomputed by `rule` (a name of RULES) at `ratio`, as a share of a full prefill's
    (layer 0 in full)."""
    counts = RULES[rule].counts(n_context, ratio, n_layers)
    return (n_context + sum(counts)) / (n_layers * n_context)


def work_share(n_context: int, n_question: int, ratio: float, n_layers: int, rule) -> float:
    """What a rule computes beside the question's own prefill, as a share of a full prefill's context-token
    layers: layer 0 in full, its counts at layers 1.., and the token-layers of its own pass over the input
    (a query rule's question at layers 0..j; extra_token_layers). rule: a name of ALL_RULES or a rule."""
    rule = ALL_RULES[rule] if isinstance(rule, str) else rule
    extra = rule.extra_token_layers(n_question, n_layers)
    return (n_context + sum(rule.counts(n_context, ratio, n_layers)) + extra) / (n_layers * n_context)


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

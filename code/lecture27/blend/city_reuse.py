"""Full KV reuse in the city language (handout §5.1-5.2): its sentences are independent, so chunks of one
sentence each, precomputed alone and placed by shift_kv, answer a question as a full prefill does; and a
chunk's K moved by RoPE's rotation equals the K computed at the new position (exercise 5), V unchanged.

    city_docs     documents of `chunks` sentences + a question sentence, and full prefill's predictions
    city_losses   the question's cross-entropy under full prefill and full reuse, KL(full || reuse)
    shift_check   exercise 5: K at 0 rotated by `shift` vs K computed at `shift`, V of both, and full reuse
                  with K left unrotated
    moved_chunk   exercise 5's shift_check beside full reuse with K rotated (city_losses)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lecture27.blend_world import precompute_chunks
from common.llama import KVCache, kl_divergence, shift_kv


@dataclass
class CityDocs:
    """Part 1's documents of the city language and full prefill's predictions of their questions."""
    model: object
    ctx: torch.Tensor               # (B, chunks x chunk_len) context tokens
    q: torch.Tensor                 # (B, chunk_len) question tokens
    lp_full: torch.Tensor           # full prefill's log-probs for question tokens 2..
    tgt: torch.Tensor               # (B, chunk_len - 1, 1) question tokens 2..


@dataclass
class City:
    ce_full: float                  # the question's cross-entropy, nats/token
    ce_reuse: float
    kl: float                       # KL(full prefill || full reuse)
    entropy: float                  # the language's true entropy of words 2-8


@dataclass(kw_only=True)
class Shift:
    shift: int
    k_rotated_max_diff: float
    k_unrotated_max_diff: float
    v_max_diff: float
    k_max_abs: float
    ce_unrotated: float
    kl_unrotated: float


def cross_entropy(lp: torch.Tensor, tgt: torch.Tensor) -> float:
    return float(-lp.gather(-1, tgt).mean())


@torch.no_grad()
def city_docs(model, lang, n_docs: int, seed: int, chunks: int, chunk_len: int) -> CityDocs:
    n_ctx = chunks * chunk_len
    x = lang.sample_text(n_docs, chunks + 1, torch.Generator().manual_seed(seed + 11))
    full, _ = model(x)
    return CityDocs(model, x[:, :n_ctx], x[:, n_ctx:], full[:, n_ctx:-1].log_softmax(-1), x[:, n_ctx + 1:, None])


@torch.no_grad()
def city_losses(d: CityDocs, lang, chunk_len: int) -> City:
    """Cross-entropy of the question's tokens (each predicted from everything before it) under full
    prefill and under full reuse of the precomputed sentence chunks, and KL(full || reuse)."""
    reuse, _ = d.model(d.q, cache=precompute_chunks(d.model, d.ctx, chunk_len))
    lp_reuse = reuse[:, :-1].log_softmax(-1)
    return City(cross_entropy(d.lp_full, d.tgt), cross_entropy(lp_reuse, d.tgt),
                float(kl_divergence(d.lp_full, lp_reuse).mean()), lang.entropy_after_first_word())


@torch.no_grad()
def shift_check(d: CityDocs, chunk_len: int, shift: int) -> Shift:
    """A chunk prefilled at positions 0.. and one prefilled at shift..; K of the first rotated by `shift`
    (shift_kv) against K of the second, V of both, every layer. Then full reuse with every chunk's K left
    where it was computed (position 0..): the question's cross-entropy and KL from full prefill."""
    model, c = d.model, chunk_len
    chunk = d.ctx[:, :c]
    _, at0 = model(chunk)
    _, at_s = model(chunk, pos=torch.arange(shift, shift + c))
    theta = model.cfg.rope_theta
    k_rot = max(float((shift_kv(k0, shift, theta) - k1).abs().max()) for k0, k1 in zip(at0.k, at_s.k))
    k_raw = max(float((k0 - k1).abs().max()) for k0, k1 in zip(at0.k, at_s.k))
    v_diff = max(float((v0 - v1).abs().max()) for v0, v1 in zip(at0.v, at_s.v))
    caches = []
    for start in range(0, d.ctx.shape[1], c):         # each chunk at 0..c-1, K not moved, at its real place
        _, kv = model(d.ctx[:, start:start + c])
        caches.append(KVCache(k=kv.k, v=kv.v, pos=kv.pos + start))
    unrot, _ = model(d.q, cache=KVCache.cat(caches))
    lp_unrot = unrot[:, :-1].log_softmax(-1)
    return Shift(shift=shift, k_rotated_max_diff=k_rot, k_unrotated_max_diff=k_raw, v_max_diff=v_diff,
                 k_max_abs=max(float(k.abs().max()) for k in at_s.k), ce_unrotated=cross_entropy(lp_unrot, d.tgt),
                 kl_unrotated=float(kl_divergence(d.lp_full, lp_unrot).mean()))


@dataclass
class Moved:
    """Exercise 5: a chunk's KV moved by `shift` (shift_check), beside full reuse with K rotated."""
    shift: Shift
    rotated: City


def moved_chunk(d: CityDocs, lang, chunk_len: int, shift: int) -> Moved:
    return Moved(shift_check(d, chunk_len, shift), city_losses(d, lang, chunk_len))

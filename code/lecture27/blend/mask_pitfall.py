"""A pitfall of selective recompute (handout §5.3): which keys the recomputed tokens see.

At layers 1..L-1, blend() computes attention for M rows only (the selected context tokens, in document
order, then the question) against all S = N + Tq keys: an (M x S) score matrix, not a square one. A
causal mask must follow each row's *position*: row i sees the keys at or before its token's place
(blend_world.position_mask).

The pitfall is the causal mask of a square prefill reused on that rectangle, aligned to its bottom right
corner, as FlashAttention's causal flag and xFormers' LowerTriangularFromBottomRightMask align it when
there are fewer queries than keys: row i sees keys 0 .. i + S - M, as if the M rows were the last M
tokens. Users reported the released blenders computing the recomputed tokens' attention this way
(LMCache issue #1152, CacheBlend issue #21). It is right for the question's rows, and for selected
tokens only when they are the last ones of the context. The rows are in document order, so selected
token i (of m, at position p_i <= N - m + i) sees every key before it and also the context tokens
p_i + 1 .. N - m + i that come after it: the future, which no prefill shows.

    bottom_right_mask   the pitfall's mask, a drop-in for blend(..., mask=...)
    record_cost         split-record accuracy in the record world with either mask (04 prints it under §5.3),
                        and how many layers of the context's KV its answers read
SmolLM2's first-token KL with either mask is measured with the rest of §5.1's study (prefix_caching.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lecture27 import blend_world as bw
from common.llama import KVCache


def bottom_right_mask(rows: torch.Tensor, n_keys: int) -> torch.Tensor:
    """(B, 1, M, n_keys): the causal mask aligned to the bottom right of the (M rows x n_keys keys)
    matrix: row i sees keys 0 .. i + n_keys - M, whatever its position `rows[:, i]` (only the shape of
    `rows` is read). The pitfall: equal to blend_world.position_mask only when the rows are the last M
    positions."""
    B, M = rows.shape
    seen = torch.arange(n_keys)[None, :] <= torch.arange(M)[:, None] + (n_keys - M)
    return seen.expand(B, 1, M, n_keys)


MASKS = {"position": bw.position_mask, "bottom-right": bottom_right_mask}  # blend's own mask, then the pitfall's


# blend() computes layer 0 in full and masks the recomputed rows' attention from layer 1 on; a layer's
# attention output is the input of the next layer's K, V, so the first K, V the mask can change are layer 2's
FIRST_LAYER_CHANGED = 2


@dataclass(frozen=True, kw_only=True)
class MaskCost:
    """Accuracy on split records of CacheBlend at `ratio` under each mask of MASKS (name -> accuracy), the
    same for the unsplit records, and layers_read: how many leading layers of the context's KV the
    answers to split records read (None when no record is split); when that is at most
    FIRST_LAYER_CHANGED, the layers a mask changes are layers the answers do not need; future_keys: how
    many context tokens after its own position each of layer 1's `picks` recomputed tokens sees under
    the bottom-right mask (none under the position mask), averaged over the picks."""
    ratio: float
    chunk_len: int
    split: dict
    unsplit: dict
    layers_read: int | None
    future_keys: float              # later context tokens a layer-1 pick sees under the pitfall, mean per pick
    picks: int                      # tokens recomputed at layer 1


@torch.no_grad()
def layers_read(model, rec: bw.Records, chunk_len: int, pre) -> int | None:
    """The fewest n such that the context's KV of a full prefill at layers 0..n-1, with full reuse's
    (`pre`) above, answers the split records as well as the full prefill does."""
    split = bw.split_mask(rec, chunk_len)
    if not split.any():
        return None
    _, full = model(rec.doc)
    target = bw.accuracy(bw.answer_correct(bw.full_prefill(model, rec), rec), split)
    L = model.cfg.n_layers
    for n in range(1, L):
        cache = KVCache(full.k[:n] + pre.k[n:], full.v[:n] + pre.v[n:], full.pos)
        if bw.accuracy(bw.answer_correct(model(rec.question, cache=cache)[0], rec), split) >= target:
            return n
    return L


@torch.no_grad()
def record_cost(model, rec: bw.Records, chunk_len: int, ratio: float, pre=None) -> MaskCost:
    """CacheBlend with the handout's filter at `ratio` on `rec`, once per mask of MASKS: accuracy on the
    split records (the ones blend must repair) and on the others; and the layers the answers read.
    `pre`: the precomputed chunks, if at hand."""
    pre = pre if pre is not None else bw.precompute_chunks(model, rec.doc, chunk_len)
    split = bw.split_mask(rec, chunk_len)
    correct, picks = {}, None
    for name, mask in MASKS.items():
        logits, trace = bw.blend(model, rec, chunk_len, ratio, pre=pre, mask=mask, trace=True)
        correct[name], picks = bw.answer_correct(logits, rec), trace.recomputed[0]
    acc = lambda ok, m: bw.accuracy(ok, m) if m.any() else None  # noqa: E731
    return MaskCost(ratio=ratio, chunk_len=chunk_len, split={n: acc(ok, split) for n, ok in correct.items()},
                    unsplit={n: acc(ok, ~split) for n, ok in correct.items()},
                    layers_read=layers_read(model, rec, chunk_len, pre), future_keys=future_keys(picks, bw.DOC_LEN),
                    picks=picks.shape[1])


def future_keys(picks: torch.Tensor, n_context: int) -> float:
    """Mean over the recomputed tokens `picks` (B, m) (positions in document order) of the context tokens
    after its own position that the bottom-right mask lets each see: pick i sees up to n_context - m + i."""
    m = picks.shape[1]
    return float((n_context - m + torch.arange(m) - picks).float().mean())

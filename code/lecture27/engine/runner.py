"""The model runner: one batched forward over every piece of work a step holds, and CacheBlend's pass.

A step's items are runs of tokens, each behind a cache of its own (`SeqCache`): a request's next token (decode), a
piece of a prompt (chunked prefill), a piece of a chunk prefilled alone to be stored. Their tokens go through the
model together, side by side on one axis: the embedding, the norms, every linear layer (q, k, v, o, the MLP) and the
head run once over all of them, which is where a CPU's time goes (a decode step reads every weight to make one
token; eight requests' tokens read them once). Attention runs item by item over the item's own cache, each token
seeing its item's keys at or before its position. An item's numbers are the ones it gets alone, up to float32
rounding of sums over a larger matrix.

A step leaves out two pieces of work whose results nothing reads. At the last layer only the rows whose logits are
asked go on past K and V: every other row's output there would feed the head alone, and its K, V are all its cache
keeps (llama.cpp's graph drops those rows there too). And attention runs in groups of ROW_GROUP rows, each reading
only the keys up to the last one a row of the group may see (`attend`): a prefill's causal rows, CacheBlend's
recomputed rows in position order. What leaving them out saves, SmolLM2 on one core, medians of 10 runs: 3.5% of 8
chat prompts' prefill, 3% of a CacheBlend pass.

The runner's model is `packed(model)`: the same weights, each linear layer's packed once into oneDNN's blocked layout
(as vLLM's CPU backend and torch.compile pack theirs), which a step's matrix products read faster than a plain
row-major weight: a decode step of 8 requests 1.6x, a 256-token prefill step 1.15x, the head's 8 rows 2.4x (SmolLM2,
one core). The numbers are the model's to float32 rounding.

`blend` is CacheBlend's pass (blend_world.blend, §5.3) over a request's reused chunks: its own forward, run in a
step beside the batch (its layers select different tokens, so it does not share the batch's matrices).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.llama import Block, causal_mask, place_chunks, rope
from lecture27 import blend_world as bw
from lecture27.engine.blocks import SeqCache, block_kv


ROW_GROUP = 64   # rows of one attention call in `attend`: smaller groups skip more keys, in more calls


def row_groups(mask: torch.Tensor) -> list:
    """[(a, b, n)]: rows a..b-1 of a mask (..., M, S) (True: may attend) in groups of ROW_GROUP, and n, one past the
    last key any of them may see (at least 1)."""
    M = mask.shape[-2]
    seen = mask.reshape(-1, M, mask.shape[-1]).any(0)   # (M, S): a key some batch row's query may see
    out = []
    for a in range(0, M, ROW_GROUP):
        b = min(a + ROW_GROUP, M)
        keys = seen[a:b].any(0).nonzero()
        out.append((a, b, int(keys[-1]) + 1 if len(keys) else 1))
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, groups=None) -> torch.Tensor:
    """Grouped-query attention of q (B, H, M, hd) over k, v (B, Hkv, S, hd), where mask (..., M, S) allows (None:
    every key), as F.scaled_dot_product_attention gives it; each group of rows (row_groups) reads only the keys up to
    its last seen one: the keys after it are masked for every row of the group, so leaving them out changes only the
    work (a third of a 256-row causal prefill's products). A mask of another dtype than bool (an additive one) goes
    to one call as it is."""
    if mask is None or mask.dtype != torch.bool or q.shape[-2] <= ROW_GROUP:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    outs = [F.scaled_dot_product_attention(q[..., a:b, :], k[..., :n, :], v[..., :n, :], attn_mask=mask[..., a:b, :n],
                                           enable_gqa=True) for a, b, n in groups or row_groups(mask)]
    return torch.cat(outs, -2)


class PackedBlock(Block):
    """A Block whose attention is `attend` (the same numbers, fewer products): the blocks of `packed(model)`."""

    def attention(self, q, k, v, mask):
        if self.keep_weights:
            return super().attention(q, k, v, mask)
        a = attend(q, k, v, mask)
        B, H, T, hd = a.shape
        return a.transpose(1, 2).reshape(B, T, H * hd)


class PackedLinear(nn.Module):
    """y = x W^T (no bias), W packed for oneDNN's matrix product (module docstring)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def can_pack() -> bool:
    """Whether this torch build packs weights for oneDNN (x86 builds do) and gets x W^T right with them."""
    try:
        w, x = torch.linspace(-1, 1, 128).reshape(8, 16), torch.linspace(-2, 2, 48).reshape(3, 16)   # no RNG drawn
        return bool(torch.allclose(PackedLinear(w)(x), x @ w.T, atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


def packed(model) -> nn.Module:
    """A copy of `model` whose blocks are PackedBlocks and whose linear layers and head are PackedLinear, sharing
    everything else (the embedding, the norms) with it; `model` itself is left as it is. Where the build cannot pack
    (can_pack), `model`."""
    if not can_pack():
        return model
    out = copy.copy(model)
    out._modules = dict(model._modules)
    blocks = []
    for blk in model.layers:
        b = copy.copy(blk)
        b.__class__ = PackedBlock
        b._modules = dict(blk._modules)
        for name in LINEARS:
            setattr(b, name, PackedLinear(getattr(blk, name).weight))
        blocks.append(b)
    out.layers = nn.ModuleList(blocks)
    out.head = PackedLinear(model.embed.weight if model.head is None else model.head.weight)
    return out


@dataclass
class Item:
    """A run of tokens behind a cache: what one unit of work puts into a step. logits: keep its last token's;
    every: keep every token's (a completion's echo scores each prompt token by the logits before it)."""
    tokens: list
    cache: SeqCache
    logits: bool
    every: bool = False

    def rows(self, a: int, b: int) -> list:
        """The step's rows a..b-1 (this item's tokens) whose logits it keeps."""
        return list(range(a, b)) if self.every else [b - 1] if self.logits else []


@torch.no_grad()
def run(model, items: list) -> list:
    """One forward over every item's tokens (module docstring); each item's cache grows by its tokens. Returns, for
    each item, its last token's logits (vocab,) when it asked for them, every token's (T, vocab) when it asked for
    every one (Item.every), else None."""
    cfg = model.cfg
    H, Hkv, hd, theta = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta
    spans, a, positions = [], 0, []
    for it in items:
        T, n = len(it.tokens), it.cache.n
        it.cache.reserve(T)
        pos = torch.arange(n, n + T)
        mask = None if T == 1 else causal_mask(pos, torch.arange(n + T))
        spans.append((a, a + T, mask, None if mask is None else row_groups(mask)))
        positions.append(pos)
        a += T
    pos = torch.cat(positions)   # every token's position in its own sequence: q and k rotated in one call a layer
    kept = [it.rows(a, b) for it, (a, b, _, _) in zip(items, spans)]   # the rows whose logits are asked, per item
    wanted = [r for rows in kept for r in rows]
    x = model.embed(torch.tensor([[t for it in items for t in it.tokens]]))
    N, last = x.shape[1], len(model.layers) - 1
    for layer, blk in enumerate(model.layers):
        h = blk.attn_norm(x)
        k = rope(blk.wk(h).view(1, N, Hkv, hd).transpose(1, 2), pos, theta)
        v = blk.wv(h).view(1, N, Hkv, hd).transpose(1, 2)
        if layer == last:   # the asked rows alone go on (module docstring); the others only write their K, V
            kv = [it.cache.write(layer, k[:, :, a:b], v[:, :, a:b]) for it, (a, b, _, _) in zip(items, spans)]
            if not wanted:
                break
            x, h = x[:, wanted], h[:, wanted]
            q = rope(blk.wq(h).view(1, len(wanted), H, hd).transpose(1, 2), pos[wanted], theta)
            outs, j = [], 0
            for it, (K, V), (_, _, mask, groups), rows in zip(items, kv, spans, kept):
                if rows:   # a last row sees every key; an item's every row, its causal rows
                    outs.append(attend(q[:, :, j:j + len(rows)], K, V, mask if it.every else None,
                                       groups if it.every else None))
                    j += len(rows)
        else:
            q = rope(blk.wq(h).view(1, N, H, hd).transpose(1, 2), pos, theta)
            outs = [attend(q[:, :, a:b], *it.cache.write(layer, k[:, :, a:b], v[:, :, a:b]), mask, groups)
                    for it, (a, b, mask, groups) in zip(items, spans)]
        o = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
        x = blk.after_attention(x, o.transpose(1, 2).reshape(1, o.shape[2], H * hd))
    for it in items:
        it.cache.n += len(it.tokens)
    logits, out, j = model.logits(x)[0] if wanted else None, [], 0
    for it, rows in zip(items, kept):
        out.append(None if not rows else logits[j:j + len(rows)] if it.every else logits[j])
        j += len(rows)
    return out


@torch.no_grad()
def blend(model, system: tuple, chunks: list, question: tuple, keys: list, blocks: list, ratio: float, rule,
          extra: int) -> tuple[torch.Tensor, SeqCache]:
    """CacheBlend over a chat's reused chunks: the system message's KV and each chunk's (blocks, as stored: each
    prefilled alone behind the system message), placed one after another (place_chunks shifts each chunk's K to its
    place, as kvstore.assemble does with the store's arrays), then blend_world.blend recomputes `ratio` of the
    tokens per layer (selected by `rule`) while the question is computed in full at every layer. keys:
    kvstore.chunk_keys of (system, chunks). Returns the question's last logits (vocab,) and the whole prompt's
    cache, room made for `extra` tokens."""
    S = len(system)
    pre = place_chunks([block_kv(b, len(key.prefix)) for key, b in zip(keys, blocks)], model.cfg.rope_theta)
    ids = [bw.PREFIX] * S + [i for i, c in enumerate(chunks) for _ in c]
    doc = bw.RagDoc(torch.tensor([[*system, *(t for c in chunks for t in c)]]), torch.tensor([list(question)]),
                    torch.tensor(ids), rag=None)
    ready = rule.ready(model, doc, doc.chunks, pre)
    logits, trace = bw.blend(model, doc, doc.chunks, ratio, rule=ready, pre=pre, trace=True)
    return logits[0, -1], SeqCache.of(trace.cache, extra)

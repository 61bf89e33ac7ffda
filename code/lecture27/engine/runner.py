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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.llama import Block, KVCache, causal_mask, place_chunks, rope
from lecture27 import blend_world as bw


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


class SeqCache:
    """One sequence's KV in one buffer (L, 2, Hkv, capacity, hd): K (after RoPE) and V of its first n tokens, at
    positions 0..n-1. A step writes its tokens' rows in place (a decode step copies one row per layer, not the
    cache), and the buffer doubles when it is full, never past `limit` tokens (the most its request can hold: the
    memory the scheduler admitted it with)."""

    def __init__(self, block: torch.Tensor, extra: int = 0):
        """block: KV (L, 2, Hkv, T, hd) of the first T tokens (a KV block: the hot cache's form); room for `extra`
        more tokens is made now."""
        L, two, H, T, hd = block.shape
        self.buf = torch.empty(L, two, H, T + max(extra, 1), hd)
        self.buf[:, :, :, :T] = block
        self.n = T
        self.limit: int | None = None

    @classmethod
    def empty(cls, cfg, extra: int) -> "SeqCache":
        return cls(torch.empty(cfg.n_layers, 2, cfg.n_kv_heads, 0, cfg.head_dim), extra)

    @classmethod
    def of(cls, cache: KVCache, extra: int = 0) -> "SeqCache":
        """From a KVCache (batch 1, positions 0..T-1), as model() and blend() return it: copied layer by layer."""
        _, H, T, hd = cache.k[0].shape
        out = cls(torch.empty(len(cache.k), 2, H, 0, hd), T + extra)
        for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
            out.write(layer, k, v)
        out.n = T
        return out

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def reserve(self, more: int) -> None:
        if self.n + more > self.buf.shape[3]:
            L, two, H, cap, hd = self.buf.shape
            size = max(2 * cap, self.n + more)
            if self.limit is not None:
                size = min(size, max(self.limit, self.n + more))
            bigger = torch.empty(L, two, H, size, hd)
            bigger[:, :, :, :self.n] = self.buf[:, :, :, :self.n]
            self.buf = bigger

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put the step's K, V (1, Hkv, T, hd) of this layer at rows n..n+T-1; K, V of rows 0..n+T-1 (views)."""
        T = k.shape[2]
        self.buf[layer, 0, :, self.n:self.n + T] = k[0]
        self.buf[layer, 1, :, self.n:self.n + T] = v[0]
        return self.buf[layer, 0, :, :self.n + T][None], self.buf[layer, 1, :, :self.n + T][None]

    def rows(self, a: int, b: int) -> torch.Tensor:
        """A copy of rows a..b-1: a KV block (L, 2, Hkv, b-a, hd)."""
        return self.buf[:, :, :, a:b].clone()

    def kvcache(self) -> KVCache:
        """The first n rows as a KVCache (views), for the code that takes one (a selection rule, kv_to_array)."""
        rows = self.buf[:, :, :, :self.n]
        return KVCache([r[0][None] for r in rows], [r[1][None] for r in rows], torch.arange(self.n))


def block_to_array(block: torch.Tensor) -> np.ndarray:
    """A KV block (L, 2, Hkv, T, hd) -> the store's float32 layout (T, L, 2, C) (kvcache.py's contract)."""
    L, two, H, T, hd = block.shape
    return block.permute(3, 0, 1, 2, 4).reshape(T, L, two, H * hd).numpy()


def array_to_block(X: np.ndarray, n_kv_heads: int) -> torch.Tensor:
    """The store's (T, L, 2, C) -> a KV block (L, 2, Hkv, T, hd)."""
    T, L, two, C = X.shape
    return torch.from_numpy(np.ascontiguousarray(X, np.float32)).reshape(T, L, two, n_kv_heads, C // n_kv_heads) \
        .permute(1, 2, 3, 0, 4).contiguous()


def block_kv(block: torch.Tensor, start: int) -> KVCache:
    """A KV block (L, 2, Hkv, T, hd) as a KVCache (views) at positions start..start+T-1, where it was prefilled."""
    pos = torch.arange(start, start + block.shape[3])
    return KVCache([b[0][None] for b in block], [b[1][None] for b in block], pos)


@dataclass
class Item:
    """A run of tokens behind a cache: what one unit of work puts into a step. logits: keep its last token's."""
    tokens: list
    cache: SeqCache
    logits: bool


@torch.no_grad()
def run(model, items: list) -> list:
    """One forward over every item's tokens (module docstring); each item's cache grows by its tokens. Returns the
    last token's logits (vocab,) of each item that asked for them, None for the others."""
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
    wanted = [b - 1 for it, (a, b, _, _) in zip(items, spans) if it.logits]   # the rows whose logits are asked
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
            kv = [kv_i for it, kv_i in zip(items, kv) if it.logits]
            outs = [attend(q[:, :, j:j + 1], K, V, None) for j, (K, V) in enumerate(kv)]   # a last row sees every key
        else:
            q = rope(blk.wq(h).view(1, N, H, hd).transpose(1, 2), pos, theta)
            outs = [attend(q[:, :, a:b], *it.cache.write(layer, k[:, :, a:b], v[:, :, a:b]), mask, groups)
                    for it, (a, b, mask, groups) in zip(items, spans)]
        o = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
        x = blk.after_attention(x, o.transpose(1, 2).reshape(1, o.shape[2], H * hd))
    for it in items:
        it.cache.n += len(it.tokens)
    rows = iter(model.logits(x)[0]) if wanted else iter(())
    return [next(rows) if it.logits else None for it in items]


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


def blend_cost(ratio: float, context: int, question: int) -> int:
    """The tokens a blend counts against a step's budget: the share of the context it recomputes, and the question."""
    return int(np.ceil(ratio * context)) + question

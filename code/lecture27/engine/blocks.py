"""A request's KV in the forms the engine keeps it: a KV block (L, 2, Hkv, T, hd), the hot cache's form and
what a prefill unit saves; a sequence's growing cache (`SeqCache`), what a step writes into; the store's array
(T, L, 2, C), kvcache.py's contract, for the tiers behind the connector. And what a CacheBlend pass counts against a
step's budget (`blend_cost`). The runner, the scheduler and the connector all import from here; none of them needs
another to read a block."""
from __future__ import annotations

import numpy as np
import torch

from common.llama import KVCache


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


def blend_cost(ratio: float, context: int, question: int) -> int:
    """The tokens a blend counts against a step's budget: the share of the context it recomputes, and the question."""
    return int(np.ceil(ratio * context)) + question

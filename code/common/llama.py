"""A small, readable LLaMA: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One forward pass serves every use in the lecture, because each layer is driven by
  hidden states of the tokens being computed  +  their positions
  +  the K/V they may attend to (a cache, possibly edited)  +  a boolean mask.
Full prefill, prefill continued from a cache, one-token decode and CacheBlend's block-diagonal
"each chunk sees only itself" prefill differ only in what is passed in, not in code.

Cache layout: the cache stores K *after* RoPE, as inference engines do. RoPE is a rotation per
channel pair, and rotations compose: R(p + d) = R(d) R(p). So a chunk's K computed at positions
0..n-1 is moved to positions p..p+n-1 by rotating it once more by p (`rope(k, p)`,
`shift_kv`), without recomputing anything. V never sees RoPE, so it does not move.

RoPE pairing: the "half-split" layout of GPT-NeoX / Hugging Face LLaMA (channel i is paired with
channel i + head_dim/2), not the interleaved (2i, 2i+1) layout of the original paper; a GGUF file's
Q/K rows are permuted back to this layout by the loader.
"""
from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V, every layer, every KV head: the lecture's ledger (FP16 -> 2 bytes)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_value


# ----------------------------------------------------------------------------------- RoPE
def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x (..., T, head_dim) by angle pos * theta^(-2i/head_dim) in channel pair (i, i+hd/2).

    pos: (T,) or (B, 1, T) positions (integers or floats; a float pos rotates by any amount).
    Angles are formed in float64 so that rotating by p then by d equals rotating by p + d to ~1e-7.
    """
    hd = x.shape[-1]
    cos, sin = _rope_tables(pos, hd, theta, x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotated_half = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated_half * sin


def _rope_tables(pos: torch.Tensor, hd: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rope's angles (..., T, hd) for these positions. Every layer rotates q and k to the
    same positions, so the last few tables are kept (in _rope_tables.kept), keyed by the positions' values."""
    kept, key = _rope_tables.kept, (pos.dtype, tuple(pos.shape), pos.numpy().tobytes(), hd, theta, dtype)
    if key not in kept:
        inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
        ang = pos.to(torch.float64)[..., None] * inv_freq  # (..., T, hd/2)
        if len(kept) >= 8:
            kept.pop(next(iter(kept)))
        kept[key] = (torch.cat([ang.cos(), ang.cos()], dim=-1).to(dtype),
                     torch.cat([ang.sin(), ang.sin()], dim=-1).to(dtype))
    return kept[key]


_rope_tables.kept = {}  # a function attribute: the cache's code key reads the function, not the tables


def shift_kv(k: torch.Tensor, delta, theta: float) -> torch.Tensor:
    """Move K (..., T, head_dim), cached after RoPE, by `delta` positions (an int, or a tensor of
    T per-token offsets): rotate once more by delta * theta^(-2i/d) (CacheBlend, appendix A).
    V carries no position and is reused as it is."""
    T = k.shape[-2]
    d = delta if isinstance(delta, torch.Tensor) else torch.full((T,), float(delta))
    return rope(k, d, theta)


# ----------------------------------------------------------------------------------- masks
def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor,
                q_chunk: torch.Tensor | None = None, k_chunk: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where query i may attend to key j: k_pos[j] <= q_pos[i].

    With chunk ids, a query also sees only keys of its own chunk: the block-diagonal mask of
    "each chunk precomputed alone" (full KV reuse).
    """
    m = k_pos[None, :] <= q_pos[:, None]
    if q_chunk is not None:
        m = m & (k_chunk[None, :] == q_chunk[:, None])
    return m


# ----------------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    """One transformer layer. `qkv` and `attend` are exposed so that CacheBlend can compute K/V
    for some tokens, write them into a cache, and let those tokens attend to the edited cache."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.wq = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.w_gate = nn.Linear(d, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(d, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, d, bias=False)
        self.keep_weights, self.weights = False, None  # see attention()

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """x (B, T, d) -> q (B, H, T, hd), k and v (B, Hkv, T, hd); q and k rotated to `pos`."""
        B, T, _ = x.shape
        c = self.cfg
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(h).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        return rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta), v

    def attention_weights(self, q, k, mask):
        """The softmax weights (B, H, T, S) of grouped-query attention of q (B, H, T, hd) over k
        (B, Hkv, S, hd) with `mask` (T, S), True = may attend: query head h reads KV head h // (H / Hkv)."""
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return scores.masked_fill(~mask, float("-inf")).softmax(-1)

    @staticmethod
    def mix(weights, v):
        """The per-head outputs (B, T, H*hd) of attention weights (B, H, T, S) over v (B, Hkv, S, hd)."""
        a = weights @ v.repeat_interleave(weights.shape[1] // v.shape[1], 1)
        B, H, T, hd = a.shape
        return a.transpose(1, 2).reshape(B, T, H * hd)

    def attention(self, q, k, v, mask):
        """Grouped-query attention: each KV head serves n_heads / n_kv_heads query heads.
        Returns the per-head outputs (B, T, H*hd), before the output projection.
        With self.keep_weights set, the softmax is written out and its weights (B, H, T, S) are kept
        in self.weights, for a training loss that looks at where tokens attend (blend_world)."""
        if self.keep_weights:
            self.weights = self.attention_weights(q, k, mask)
            return self.mix(self.weights, v)
        # enable_gqa: query head h reads KV head h // (n_heads / n_kv_heads), without copying K, V
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        B, H, T, hd = a.shape
        return a.transpose(1, 2).reshape(B, T, H * hd)

    def attend(self, x, q, k, v, mask):
        """Residual attention over (k, v) with `mask`, then the residual SwiGLU MLP."""
        return self.after_attention(x, self.attention(q, k, v, mask))

    def after_attention(self, x, a):
        """The rest of the layer, given the per-head attention outputs a (B, T, H*hd): output projection
        and residual, then the residual SwiGLU MLP."""
        x = x + self.wo(a)
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    def forward(self, x, pos, past_kv=None, past_pos=None, mask=None):
        """x (B, T, d) at positions pos (T,); past_kv = (k, v) of earlier tokens at past_pos.
        mask (T, S+T) bool, True = may attend; default: causal over positions.
        Returns (new hidden states, k and v of the past and these T tokens: the layer's new cache)."""
        q, k, v = self.qkv(x, pos)
        k_pos = pos
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
            k_pos = torch.cat([past_pos, pos])
        if mask is None:
            mask = causal_mask(pos, k_pos)
        return self.attend(x, q, k, v, mask), k, v


@dataclass
class KVCache:
    """Per-layer K (after RoPE) and V, each (B, n_kv_heads, S, head_dim), and the S positions."""
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    pos: torch.Tensor | None = None

    def __len__(self):
        return 0 if self.pos is None else len(self.pos)

    def layer(self, i):
        return (self.k[i], self.v[i]) if self.k else None

    @staticmethod
    def cat(caches: list["KVCache"]) -> "KVCache":
        """Concatenate caches along the token axis (e.g. chunks precomputed separately)."""
        n = len(caches[0].k)
        return KVCache(k=[torch.cat([c.k[i] for c in caches], 2) for i in range(n)],
                       v=[torch.cat([c.v[i] for c in caches], 2) for i in range(n)],
                       pos=torch.cat([c.pos for c in caches]))



def place_chunks(caches: list[KVCache], theta: float) -> KVCache:
    """Chunks' caches placed one after another, in order: each K rotated by shift_kv from where it was
    prefilled (its pos) to where it now sits (V carries no position); a cache already in place (a shared
    prefix, the first chunk) is not rotated. How reused chunks become one context's cache (CacheBlend, §5)."""
    out, start = [], 0
    for c in caches:
        delta = start - int(c.pos[0])
        out.append(KVCache(k=[shift_kv(k, delta, theta) for k in c.k] if delta else c.k, v=c.v, pos=c.pos + delta))
        start += len(c)
    return KVCache.cat(out)

def kv_to_array(cache: KVCache) -> np.ndarray:
    """KVCache (per layer (B, Hkv, T, hd)) -> float32 array (B, T, L, 2, C): the codec's and the store's
    layout, token by token, each token's layers, K then V, its C = Hkv * hd channels."""
    kvs = torch.stack([torch.stack(cache.k, 1), torch.stack(cache.v, 1)], 2)  # (B, L, 2, H, T, hd)
    B, L, _, H, T, hd = kvs.shape
    return kvs.permute(0, 4, 1, 2, 3, 5).reshape(B, T, L, 2, H * hd).float().numpy()


def array_to_kv(X, n_kv_heads: int, pos=None) -> KVCache:
    """Inverse of kv_to_array: (B, T, L, 2, C) or (T, L, 2, C) -> KVCache at positions pos (0..T-1)."""
    X = torch.as_tensor(np.asarray(X, np.float32))
    X = X[None] if X.dim() == 4 else X
    B, T, L, _, C = X.shape
    t = X.reshape(B, T, L, 2, n_kv_heads, C // n_kv_heads).permute(2, 3, 0, 4, 1, 5)  # (L, 2, B, H, T, hd)
    return KVCache(k=[t[i, 0].contiguous() for i in range(L)], v=[t[i, 1].contiguous() for i in range(L)],
                   pos=torch.arange(T) if pos is None else pos)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def logits(self, x):
        x = self.norm(x)
        return x @ self.embed.weight.T if self.head is None else self.head(x)

    def forward(self, tokens, pos=None, cache: KVCache | None = None, mask=None, last: bool = False):
        """tokens (B, T). pos (T,) defaults to len(cache) + arange(T).
        mask (T, len(cache) + T) bool defaults to causal over positions.
        last: logits of the last position only (B, 1, vocab), all a prefill needs to pick the next token;
        with SmolLM2's 49,152-token vocabulary the other positions' logits cost ~10% of a long prefill.
        Returns (logits (B, T, vocab), KVCache of cache + these tokens)."""
        T = tokens.shape[1]
        start = len(cache) if cache is not None else 0
        if pos is None:
            pos = torch.arange(start, start + T)
        new_pos = pos if cache is None or cache.pos is None else torch.cat([cache.pos, pos])
        if mask is None:
            mask = causal_mask(pos, new_pos)  # built once, shared by every layer
        x = self.embed(tokens)
        ks, vs = [], []
        for i, blk in enumerate(self.layers):
            past = cache.layer(i) if cache is not None else None
            x, k, v = blk(x, pos, past, cache.pos if past else None, mask)
            ks.append(k)
            vs.append(v)
        return self.logits(x[:, -1:] if last else x), KVCache(ks, vs, new_pos)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ----------------------------------------------------------------------------------- comparing and running
@torch.no_grad()
def greedy(model, logits: torch.Tensor, cache, n: int, stop: int | None = None) -> list[list[int]]:
    """Greedy continuations of B inputs at once, from their first answer token's logits (B, vocab) and
    their caches stacked on the batch axis: up to n tokens each, a row ending at `stop`.
    Decoding is bound by reading the weights, so B rows cost about as much as one."""
    out, done = [[] for _ in range(logits.shape[0])], [False] * logits.shape[0]
    for step in range(n):
        t = logits.argmax(-1)  # (B,)
        for b, tok in enumerate(t.tolist()):
            if not done[b]:
                out[b].append(tok)
                done[b] = tok == stop
        if all(done) or step == n - 1:
            break
        lg, cache = model(t[:, None], cache=cache, last=True)
        logits = lg[:, -1]
    return out


@torch.no_grad()
def product_seconds(model, rows: int, head_rows: int, repeats: int = 3) -> float:
    """The least of `repeats` timings of the matrix products of `rows` rows through every block's linear layers and
    of `head_rows` rows through the head (model: a common.llama.Llama, its weights packed or not), on this process's
    torch threads: the floor under a step that computes those rows (nothing but its products). The least time is
    the core undisturbed."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    x, h = torch.randn(rows, cfg.d_model, generator=g), torch.randn(rows, cfg.d_ff, generator=g)
    a = torch.randn(rows, cfg.n_heads * cfg.head_dim, generator=g)

    def products():
        for blk in model.layers:
            blk.wq(x), blk.wk(x), blk.wv(x), blk.wo(a), blk.w_gate(x), blk.w_up(x), blk.w_down(h)
        model.logits(x[:head_rows])   # the head (and the final norm, a row's few hundred operations)

    products()   # the first call pays for the packing's first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        products()
        best = min(best, time.perf_counter() - t0)
    return best


def kl_divergence(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats over the last axis, from log-probabilities (e.g. a full prefill's next-token
    distribution p against a method's q); one value per row."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def cpu_times(stat_line: str) -> tuple[int, int]:
    """(idle, total) jiffies from /proc/stat's first line "cpu user nice system idle iowait irq ...":
    idle counts idle and iowait."""
    t = [int(x) for x in stat_line.split()[1:]]
    return t[3] + t[4], sum(t)


def idle_cores(window: float = 0.2) -> float | None:
    """How many cores are idle right now: the idle share of two reads of /proc/stat `window` seconds
    apart, times the core count. None where that cannot be read (not Linux)."""
    def read():
        with open("/proc/stat") as f:
            return cpu_times(f.readline())

    try:
        idle0, total0 = read()
        time.sleep(window)
        idle1, total1 = read()
    except (OSError, ValueError, IndexError):
        return None
    return (idle1 - idle0) / max(1, total1 - total0) * (os.cpu_count() or 1)


@contextmanager
def torch_threads(n: int):
    """Run the block on n torch threads, then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def idle_threads():
    """Run the block on one torch thread per idle core, at most torch's current count, at least one.
    A real model's long prefills run 1.9x faster on two idle cores than on one (SmolLM2, 1,570 tokens),
    but a thread whose core another process holds stalls every parallel step: with one of two cores
    busy, two threads made SmolLM2's CacheBlend runs 8x slower than one. Unknown (not Linux): one."""
    idle = idle_cores()
    return torch_threads(max(1, min(torch.get_num_threads(), int(idle + 0.25) if idle is not None else 1)))


def single_thread():
    """Run the block on one torch thread, then restore the count: small batches gain little from a
    second thread, and a thread waiting for a core another process holds slows every step down."""
    return torch_threads(1)

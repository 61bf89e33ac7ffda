"""A context's KV built chunk by chunk, as a CacheGen receiver builds it (handout §4.2): each chunk's KV put
after the KV of the chunks before it, either decoded from its bitstream (kvcache.codec_decode, then
dequantized) or recomputed from its text by the model attending to the KV so far."""
from __future__ import annotations

import torch

from lecture27 import kvcache as kv
from common.llama import KVCache, array_to_kv


def head(cache: KVCache, n: int) -> KVCache | None:
    """The cache's first n tokens (None for none)."""
    if n == 0:
        return None
    return KVCache([k[:, :, :n] for k in cache.k], [v[:, :, :n] for v in cache.v], cache.pos[:n])


def decode_onto(cache: KVCache | None, data: bytes, spec, n_kv: int, first: int, n: int):
    """A KV chunk's bitstream decoded (raises CorruptStream or ValueError) and its KV put after `cache`:
    (the quantized integers, the cache with the chunk)."""
    q = kv.codec_decode(data, spec)
    part = array_to_kv(kv.dequantize(q, spec), n_kv, pos=torch.arange(first, first + n))
    return q, part if cache is None else KVCache.cat([cache, part])


def recompute_onto(model, cache: KVCache | None, ids, first: int, n: int) -> KVCache:
    """A text chunk recomputed: the model's prefill of ids[first:first + n] after `cache` (the exact KV)."""
    with torch.no_grad():
        _, cache = model(torch.tensor([list(ids[first:first + n])]), cache=cache, last=True)
    return cache

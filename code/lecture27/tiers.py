"""Storage tiers for KV chunks (§6.3, §7): the small piece that 05_tiered_storage.py builds on.

A `SimTier` is one simulated level of storage (GPU HBM, CPU DRAM, SSD, ...): it holds chunks' sizes, not
their bytes (kvstore.py's tiers hold real records), with a capacity in bytes, the bandwidth at which KV
read from it reaches the GPU, and an eviction policy:
  - LRU (the default): evict the least recently used chunk. It sees only tokens, like a backend behind
    the OpenAI API.
  - hint-aware (`hinted=True`): chunks the application marked "will be reused" are evicted only when no
    unmarked chunk is left; among each kind, LRU. This is what a richer API would let a backend do (§7).

A `TieredStore` stacks tiers, fastest first (tiers[0] is the GPU), and behaves as LMCache does:
  - store:  write-through, every chunk is written to every tier (already there -> most recently used);
  - lookup: the longest cached prefix, chunk by chunk, each chunk taken from the fastest tier holding it;
  - fetch:  a chunk found below the GPU costs bytes / that tier's bandwidth and is copied up into every
            faster tier (copy-up).
Chunks of one prompt are touched and written tail first, so a prompt's head chunk is its most recently
used: LRU then evicts a prefix from its tail (as vLLM's prefix cache does), never its head first, which
would make all the chunks after it unreachable.
A chunk is identified by a key that names its whole prefix (prefix caching: chunk i of a conversation
is reusable only together with chunks 0..i-1), so the caller passes keys in prompt order. A cache whose
keys name only a chunk's own content (non-prefix reuse, §5) looks every key up on its own instead:
`lookup(keys, prefix=False)` / `fetch(keys, sizes, prefix=False)` go on past a missing chunk.

Note the inclusion property of write-through LRU tiers: all tiers see the same writes in the same
order, so a tier no bigger than the one above it holds nothing the upper tier lacks (it only
survives the upper tier's loss). A lower tier helps only if it is larger.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


class SimTier:
    """One simulated storage level. Chunks are (key -> nbytes); two LRU lists: unhinted and "will be reused"."""

    def __init__(self, name: str, capacity: float, bandwidth: float = math.inf, hinted: bool = False):
        if capacity < 0 or bandwidth <= 0:
            raise ValueError(f"tier {name}: capacity must be >= 0 and bandwidth > 0")
        self.name, self.capacity, self.bandwidth, self.hinted = name, capacity, bandwidth, hinted
        self.plain: OrderedDict = OrderedDict()   # key -> nbytes, least recently used first
        self.reused: OrderedDict = OrderedDict()  # chunks marked "will be reused" (kept apart only if hinted)
        self.used = 0
        self.evictions = 0

    def __contains__(self, key) -> bool:
        return key in self.plain or key in self.reused

    def __len__(self) -> int:
        return len(self.plain) + len(self.reused)

    def keys_lru_order(self) -> list:
        """Eviction order (next victim first)."""
        return list(self.plain) + list(self.reused)

    def touch(self, key) -> None:
        """Mark a chunk most recently used."""
        (self.plain if key in self.plain else self.reused).move_to_end(key)

    def put(self, key, nbytes: int, reuse: bool = False) -> bool:
        """Write a chunk (or touch it if present). Evicts until it fits; a chunk bigger than the whole
        tier is not stored. Returns whether the chunk is now in the tier."""
        if key in self:
            self.touch(key)
            return True
        if nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            self._evict_one()
        (self.reused if (reuse and self.hinted) else self.plain)[key] = nbytes
        self.used += nbytes
        return True

    def _evict_one(self) -> None:
        victims = self.plain if self.plain else self.reused  # unmarked chunks go first
        _, nbytes = victims.popitem(last=False)               # least recently used of them
        self.used -= nbytes
        self.evictions += 1


@dataclass
class Fetch:
    """Result of looking up one prompt: where each cached chunk was found and what loading it costs."""
    tier_of_chunk: list      # tier index per chunk of the longest cached prefix (or per key, None: missing)
    bytes_per_tier: list     # bytes found in each tier
    load_s: float            # sum over chunks below the GPU of bytes / tier bandwidth

    @property
    def n_chunks(self) -> int:
        """Chunks found."""
        return sum(i is not None for i in self.tier_of_chunk)


class TieredStore:
    """Tiers fastest first; tiers[0] is the GPU (bandwidth inf: KV already there costs nothing to use)."""

    def __init__(self, tiers: list[SimTier]):
        if not tiers:
            raise ValueError("need at least one tier")
        self.tiers = tiers

    def lookup(self, keys, prefix: bool = True) -> list:
        """For each chunk in order, the index of the fastest tier holding it. A prefix (the default):
        stops at the first chunk no tier holds, the longest cached prefix. prefix=False: every key on
        its own, None where no tier holds it."""
        found = []
        for key in keys:
            i = next((i for i, tier in enumerate(self.tiers) if key in tier), None)
            if i is None and prefix:
                break
            found.append(i)
        return found

    def fetch(self, keys, sizes, prefix: bool = True) -> Fetch:
        """Look up the keys (as `lookup`), charge the loads, touch each chunk where it was found and copy
        chunks found below the GPU up into every faster tier."""
        where = self.lookup(keys, prefix)
        per_tier = [0] * len(self.tiers)
        load_s = 0.0
        hits = [(key, nbytes, i) for key, nbytes, i in zip(keys, sizes, where) if i is not None]
        for key, nbytes, i in hits:
            per_tier[i] += nbytes
            if i > 0:
                load_s += nbytes / self.tiers[i].bandwidth
        hits = hits[::-1]  # tail first, so the prefix's head ends most recent
        for key, nbytes, i in hits:
            self.tiers[i].touch(key)
        for key, nbytes, i in hits:  # copy-up, after every hit was touched
            if i > 0:
                reuse = key in self.tiers[i].reused  # the hint travels with the chunk
                for upper in self.tiers[:i]:
                    upper.put(key, nbytes, reuse)
        return Fetch(where, per_tier, load_s)

    def store(self, keys, sizes, reuse: bool = False) -> None:
        """Write-through: every chunk to every tier (present chunks become most recently used).
        `reuse` is the application's hint; only hint-aware tiers act on it."""
        for tier in self.tiers:
            for key, nbytes in zip(keys[::-1], sizes[::-1]):  # tail first, as in fetch
                tier.put(key, nbytes, reuse)
